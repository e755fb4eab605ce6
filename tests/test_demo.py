"""The demo model: seeded, Llama-shaped, and quantized the way the README says."""
import torch

from fp8linear.demo import DemoConfig, build_model, run_demo

SMALL = DemoConfig(vocab_size=300, hidden_size=256, intermediate_size=384, num_layers=2,
                   num_heads=4, num_kv_heads=2, batch=2, seq_len=16)


def test_build_model_is_seeded_and_llama_named():
    a, b = build_model(SMALL), build_model(SMALL)
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb)
    other = build_model(DemoConfig(**{**SMALL.__dict__, "seed": 1}))
    assert not torch.equal(other.layers[0].mlp.up_proj.weight, a.layers[0].mlp.up_proj.weight)
    names = set(a.state_dict())
    assert {"embed_tokens.weight", "layers.1.self_attn.k_proj.weight",
            "layers.0.mlp.gate_proj.weight", "norm.weight", "lm_head.weight"} <= names
    assert a.layers[0].self_attn.k_proj.weight.shape == (128, 256)  # grouped KV heads


def test_model_is_causal():
    model = build_model(SMALL, dtype=torch.float32)
    ids = torch.randint(0, 300, (1, 10))
    changed = ids.clone()
    changed[0, 7] = (ids[0, 7] + 1) % 300
    with torch.no_grad():
        _, la = model(ids)
        _, lb = model(changed)
    assert torch.equal(la[0, :7], lb[0, :7]) and not torch.equal(la[0, 7:], lb[0, 7:])


def test_run_demo_small():
    r = run_demo(SMALL, device="cpu")
    assert r["quantized_layers"] == 14 and r["tokens"] == 32
    assert r["linear_weight_bytes"][1] < 0.52 * r["linear_weight_bytes"][0]
    assert 0 < r["logits_rel_err"] < 0.15 and r["top1_agreement"] > 0.7
    assert r["dtype"] == "bfloat16" and r["time_ms"] is None
