// A fixture of scripts/check-layers.sh (never compiled): only src/capi includes kvrouter.h.
#include "core/types.h"
#include "kvrouter.h"
