// Planted for the layering check: a wire test including the ingest layer above it.
#include "core/types.h"
#include "ingest/ingest_loop.h"
