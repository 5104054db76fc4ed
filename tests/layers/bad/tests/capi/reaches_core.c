/* Planted for the layering check: a C ABI test reaching into the core. */
#include "core/router.h"
#include "kvrouter.h"
