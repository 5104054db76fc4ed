/* include/kvrouter.h may be included twice (and after its version header). */
#include <string.h>

#include "kvrouter.h"
#include "kvrouter_version.h"

int main(void) { return strcmp(kvr_version_string(), KVR_VERSION_STRING) == 0 ? 0 : 1; }
