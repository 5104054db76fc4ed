/* Written for the frozen kvrouter.h beside it (tests/abi/README.md): its release's version. */
#ifndef KVROUTER_VERSION_H
#define KVROUTER_VERSION_H

#define KVR_VERSION_MAJOR 0
#define KVR_VERSION_MINOR 2
#define KVR_VERSION_PATCH 1
#define KVR_VERSION_STRING "0.2.1"
#define KVR_VERSION_NUMBER (KVR_VERSION_MAJOR * 10000 + KVR_VERSION_MINOR * 100 + KVR_VERSION_PATCH)

#endif /* KVROUTER_VERSION_H */
