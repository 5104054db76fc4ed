/* kvrouter: a KV-cache-aware LLM request router, as a C ABI.
 *
 * This header is the whole public interface of libkvrouter. It is C99, has no dependencies
 * beyond the C standard library, and grows by appending only. Until the full ABI lands it
 * offers the library version.
 *
 * Thread-safety: every function here may be called from any thread at any time.
 */
#ifndef KVROUTER_H
#define KVROUTER_H

#include <stdint.h>

#include "kvrouter_version.h"

#if defined(_WIN32) && defined(KVR_BUILDING_LIBRARY)
#define KVR_API __declspec(dllexport)
#elif defined(_WIN32) && !defined(KVR_STATIC)
#define KVR_API __declspec(dllimport)
#elif defined(__GNUC__) && __GNUC__ >= 4
#define KVR_API __attribute__((visibility("default")))
#else
#define KVR_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The library's version as KVR_VERSION_NUMBER computes it (major*10000 + minor*100 + patch).
 * Compare with KVR_VERSION_NUMBER to detect a header/library mismatch.
 * @thread_safety concurrent */
KVR_API uint32_t kvr_version(void);

/* The library's version as "MAJOR.MINOR.PATCH"; a static string, never NULL.
 * @thread_safety concurrent */
KVR_API const char *kvr_version_string(void);

#ifdef __cplusplus
}
#endif

#endif /* KVROUTER_H */
