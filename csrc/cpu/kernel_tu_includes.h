// What every kernels_<isa>.cpp includes before its `#pragma GCC target`: the standard
// headers the *_impl.h files expect (they are included inside an anonymous namespace, so
// they cannot include these themselves) and the shared kernel API.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <type_traits>

#include "isa_generated.h"
#include "kernel_api.h"
#include "kernel_shapes_generated.h"
