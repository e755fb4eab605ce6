// The limits of sm90/tables.def as C++ constants (the tables are expanded where they are used).
#pragma once

namespace fp8l {
#define FP8L_LIMIT(name, value) constexpr int name = value;
#include "sm90/tables.def"
}  // namespace fp8l
