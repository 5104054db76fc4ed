// A fixture of scripts/check-layers.sh (never compiled): core including layers above it.
#include "core/router.h"
#include "ingest/ingest_service.h"
#include "../wire/framing.h"
