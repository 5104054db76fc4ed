// The version entry points of the C ABI.
#include "kvrouter.h"

extern "C" {

KVR_API uint32_t kvr_version(void) { return KVR_VERSION_NUMBER; }

KVR_API const char* kvr_version_string(void) { return KVR_VERSION_STRING; }

}  // extern "C"
