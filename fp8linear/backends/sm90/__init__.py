"""The Hopper backend: ``backend`` (entry points), ``launch`` and ``plan`` (what runs),
``tiles`` (the tables shared with csrc/sm90), ``build`` (the kernel library)."""
