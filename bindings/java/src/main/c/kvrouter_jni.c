/* kvrouter_jni.c: the JNI glue of the Java binding (package io.kvrouter).
 *
 * Calls only the functions of kvrouter.h. Each Java_io_kvrouter_Native_* function converts its
 * arguments, makes one C call (or a few, to grow a result buffer) and converts the results.
 *
 * Rules kept everywhere:
 * - Every kvr_status other than KVR_OK becomes a thrown io.kvrouter.KvRouterException carrying
 *   the status and the kvr_error's message; the kvr_error is always freed.
 * - Every JNI call that can throw is checked before the next JNI call; a function returns as
 *   soon as an exception is pending, and never calls kvrouter with one pending.
 * - Temporary memory (converted strings, copied arrays, result buffers) comes from a per-call
 *   scratch area: a fixed block on the stack, then malloc'd blocks freed on every return path.
 *   Library-owned results (kvr_buffer) are freed as soon as they are copied.
 * - Inputs are borrowed for the call only (kvrouter.h copies what it keeps). Arrays that feed
 *   calls that take no lock a thread calling into Java can hold (hashing, event batches,
 *   snapshots, overlap scores: the index's lock at most) are read in place with
 *   GetPrimitiveArrayCritical; every other array is copied with Get*ArrayRegion. A critical
 *   region must not block nor call JNI, nor wait for a thread that does: every routing
 *   decision, previews included, takes the router's admission lock, which a booking thread
 *   holds while it calls the replica publisher in Java (an allocation there may need a
 *   collection, which waits for every critical region to end), and admitted routing can wait
 *   in the admission queue.
 * - Structs cross JNI as long[] arrays in the slots of the generated kvrouter_jni_abi.h, through
 *   its codecs (abi_encode_* / abi_decode_*); no field is counted by hand here. Every struct
 *   handed to the library, options and results alike, is first initialised by its _init with
 *   the size the glue was compiled with (INIT below), which also sets struct_size; a refusal
 *   throws.
 * - Strings go to C as real UTF-8 (not JNI's modified UTF-8: LoRA names and namespaces are
 *   hashed) and come back through String(byte[], "UTF-8") unless they are ASCII.
 * - No global state but class and field references, set once when the library loads.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime (the overhead benchmark's C loop) */
#include <jni.h>
#include <stdalign.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "io_kvrouter_Native.h"
#include "kvrouter.h"
#include "kvrouter_jni_abi.h"

/* ---- Layouts ------------------------------------------------------------------------------
 * Structs cross as long[] in the slots of kvrouter_jni_abi.h (io.kvrouter.Abi in Java), both
 * generated from kvrouter.h by tools/ffigen/ffigen.py. What the glue adds is spelled out here. */

/* Native.findBestMatch's result array: a kvr_route_result's slots, then the candidate count. */
enum { ROUTE_RESULT_TOTAL_CANDIDATES = ABI_ROUTE_RESULT_LEN, ROUTE_RESULT_OUT_LEN };

/* ---- Cached classes and fields -------------------------------------------------------------- */

static jclass g_exception;         /* io.kvrouter.KvRouterException */
static jmethodID g_exception_init; /* (int, String) */
static jclass g_string;            /* java.lang.String */
static jmethodID g_string_init;    /* (byte[], String) */
static jstring g_utf8;             /* "UTF-8" */
static JavaVM* g_vm;
static jmethodID g_sink_publish; /* io.kvrouter.ReplicaSink.publish(byte[]) */

static struct {
  jfieldID scalars, request_id, lora_name, cache_namespace, mm_hashes, mm_counts, allowed;
} g_request;
static struct { jfieldID scalars, session_id; } g_hints;
static struct {
  jfieldID scalars, block_hashes, local_hashes, token_ids, lora_name, cache_namespace, mm_hashes,
      mm_counts;
} g_stored;
static struct { jfieldID scalars, block_hashes; } g_removed;

/* ---- Handles -------------------------------------------------------------------------------- */

#define ROUTER(h) ((kvr_router*)(intptr_t)(h))
#define DISAGG(h) ((kvr_disagg*)(intptr_t)(h))
#define BATCH(h) ((kvr_event_batch*)(intptr_t)(h))
#define INGEST(h) ((kvr_ingest*)(intptr_t)(h))
#define PUBLISHER(h) ((kvr_publisher*)(intptr_t)(h))
#define HANDLE(p) ((jlong)(intptr_t)(p))

/* ---- Exceptions ----------------------------------------------------------------------------- */

static void throw_named(JNIEnv* env, const char* class_name, const char* message) {
  if ((*env)->ExceptionCheck(env)) return;
  jclass cls = (*env)->FindClass(env, class_name);
  if (cls == NULL) return; /* NoClassDefFoundError (or OutOfMemoryError) is pending */
  (*env)->ThrowNew(env, cls, message);
  (*env)->DeleteLocalRef(env, cls);
}

static int throw_oom(JNIEnv* env, const char* what) {
  throw_named(env, "java/lang/OutOfMemoryError", what);
  return -1;
}

static int throw_iae(JNIEnv* env, const char* message) {
  throw_named(env, "java/lang/IllegalArgumentException", message);
  return -1;
}

/* A Java string from NUL-terminated UTF-8; NULL with an exception pending on failure. */
static jstring new_string(JNIEnv* env, const char* utf8) {
  size_t n = strlen(utf8);
  size_t i = 0;
  while (i < n && (unsigned char)utf8[i] < 0x80) ++i;
  if (i == n) return (*env)->NewStringUTF(env, utf8); /* ASCII: modified UTF-8 is the same */
  if (n > (size_t)INT32_MAX) {
    throw_oom(env, "string too long");
    return NULL;
  }
  jbyteArray bytes = (*env)->NewByteArray(env, (jsize)n);
  if (bytes == NULL) return NULL;
  (*env)->SetByteArrayRegion(env, bytes, 0, (jsize)n, (const jbyte*)utf8);
  if ((*env)->ExceptionCheck(env)) {
    (*env)->DeleteLocalRef(env, bytes);
    return NULL;
  }
  jstring s = (jstring)(*env)->NewObject(env, g_string, g_string_init, bytes, g_utf8);
  (*env)->DeleteLocalRef(env, bytes);
  return s; /* NULL if the constructor threw */
}

/* Throws KvRouterException(code, message) unless an exception is pending. */
static void throw_kvr(JNIEnv* env, kvr_status code, const char* message) {
  if ((*env)->ExceptionCheck(env)) return;
  jstring jmessage = new_string(env, message);
  if (jmessage == NULL) return;
  jthrowable e =
      (jthrowable)(*env)->NewObject(env, g_exception, g_exception_init, (jint)code, jmessage);
  (*env)->DeleteLocalRef(env, jmessage);
  if (e == NULL) return;
  (*env)->Throw(env, e);
  (*env)->DeleteLocalRef(env, e);
}

/* Throws KvRouterException(status, message) and frees err. */
static void throw_status(JNIEnv* env, kvr_status status, kvr_error* err) {
  /* The error carries the status returned; it is the one thrown when there is an error. */
  const kvr_status code = err != NULL ? kvr_error_status(err) : status;
  const char* message = err != NULL ? kvr_error_message(err) : "";
  if (message[0] == '\0') message = kvr_status_str(code);
  throw_kvr(env, code, message);
  kvr_error_free(err);
}

/* 0 for KVR_OK; otherwise throws, frees *err and returns -1. Takes the error's address, not
 * its value: in check(env, kvr_call(..., &err), &err) the order in which C evaluates the
 * arguments is unspecified, but *err is only read in here, after the call returned. */
static int check(JNIEnv* env, kvr_status status, kvr_error** err) {
  kvr_error* e = *err;
  *err = NULL;
  if (status == KVR_OK) {
    if (e != NULL) kvr_error_free(e); /* NULL after a success; freed all the same */
    return 0;
  }
  throw_status(env, status, e);
  return -1;
}

/* Initialises a struct with the library's defaults for the size the glue was compiled with
 * (which the library records in struct_size): INIT(env, kvr_router_options_init, &options).
 * 0, or -1 with a KvRouterException pending if the library refuses that size (a library older
 * than the struct's first layout; the version check on loading keeps that from happening). */
#define INIT(env, init, c) init_checked((env), init((c), sizeof *(c)), #init)

static int init_checked(JNIEnv* env, kvr_status status, const char* init) {
  if (status == KVR_OK) return 0;
  char message[256];
  snprintf(message, sizeof message,
           "kvrouter: %s refused the struct size the Java binding was built with (%s); the "
           "binding needs kvrouter %d.%d.x",
           init, kvr_status_str(status), KVR_VERSION_MAJOR, KVR_VERSION_MINOR);
  throw_kvr(env, status, message);
  return -1;
}

/* ---- Per-call scratch memory ---------------------------------------------------------------- */

#define SCRATCH_STACK_BYTES 8192

typedef union block_header {
  union block_header* next;
  max_align_t align;
} block_header;

typedef struct {
  alignas(max_align_t) unsigned char stack[SCRATCH_STACK_BYTES];
  size_t used;
  block_header* heap;
} scratch;

static void scratch_init(scratch* s) {
  s->used = 0;
  s->heap = NULL;
}

static void scratch_free(scratch* s) {
  while (s->heap != NULL) {
    block_header* next = s->heap->next;
    free(s->heap);
    s->heap = next;
  }
}

/* n bytes aligned for any type, valid until scratch_free; NULL with OutOfMemoryError pending. */
static void* scratch_alloc(JNIEnv* env, scratch* s, size_t n) {
  const size_t align = alignof(max_align_t);
  if (n == 0) n = 1;
  if (n > SIZE_MAX - sizeof(block_header) - align) {
    throw_oom(env, "kvrouter: allocation too large");
    return NULL;
  }
  n = (n + align - 1) / align * align;
  if (n <= SCRATCH_STACK_BYTES - s->used) {
    void* p = s->stack + s->used;
    s->used += n;
    return p;
  }
  block_header* b = (block_header*)malloc(sizeof(block_header) + n);
  if (b == NULL) {
    throw_oom(env, "kvrouter: out of native memory");
    return NULL;
  }
  b->next = s->heap;
  s->heap = b;
  return b + 1;
}

/* count elements of size bytes each, with overflow checked. */
static void* scratch_array(JNIEnv* env, scratch* s, size_t count, size_t size) {
  if (size != 0 && count > SIZE_MAX / size) {
    throw_oom(env, "kvrouter: allocation too large");
    return NULL;
  }
  return scratch_alloc(env, s, count * size);
}

/* ---- Conversions: Java to C ----------------------------------------------------------------- */

/* A Java string as NUL-terminated UTF-8 in scratch memory; NULL for a null string. Refuses
 * embedded NULs (C would cut the string there) and unpaired surrogates. */
static int utf8_n(JNIEnv* env, scratch* s, jstring str, jsize n, const char** out);

static int utf8(JNIEnv* env, scratch* s, jstring str, const char** out) {
  if (str == NULL) {
    *out = NULL;
    return 0;
  }
  return utf8_n(env, s, str, (*env)->GetStringLength(env, str), out);
}

/* utf8 for a string whose length (in UTF-16 units) the caller passed along from Java: one JNI
 * call less. */
static int utf8_n(JNIEnv* env, scratch* s, jstring str, jsize n, const char** out) {
  *out = NULL;
  if (str == NULL) return 0;
  jchar* units = (jchar*)scratch_array(env, s, (size_t)n, sizeof(jchar));
  if (units == NULL) return -1;
  (*env)->GetStringRegion(env, str, 0, n, units);
  if ((*env)->ExceptionCheck(env)) return -1;
  unsigned char* u = (unsigned char*)scratch_array(env, s, (size_t)n * 3 + 1, 1);
  if (u == NULL) return -1;
  size_t k = 0;
  for (jsize i = 0; i < n; ++i) {
    uint32_t c = units[i];
    if (c == 0) return throw_iae(env, "kvrouter: strings may not contain NUL characters");
    if (c >= 0xD800 && c <= 0xDFFF) {
      if (c > 0xDBFF || i + 1 >= n || units[i + 1] < 0xDC00 || units[i + 1] > 0xDFFF) {
        return throw_iae(env, "kvrouter: string with an unpaired surrogate");
      }
      c = 0x10000 + ((c - 0xD800) << 10) + (uint32_t)(units[i + 1] - 0xDC00);
      ++i;
    }
    if (c < 0x80) {
      u[k++] = (unsigned char)c;
    } else if (c < 0x800) {
      u[k++] = (unsigned char)(0xC0 | (c >> 6));
      u[k++] = (unsigned char)(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      u[k++] = (unsigned char)(0xE0 | (c >> 12));
      u[k++] = (unsigned char)(0x80 | ((c >> 6) & 0x3F));
      u[k++] = (unsigned char)(0x80 | (c & 0x3F));
    } else { /* a surrogate pair: 2 units in, 4 bytes out, within the 3-per-unit budget */
      u[k++] = (unsigned char)(0xF0 | (c >> 18));
      u[k++] = (unsigned char)(0x80 | ((c >> 12) & 0x3F));
      u[k++] = (unsigned char)(0x80 | ((c >> 6) & 0x3F));
      u[k++] = (unsigned char)(0x80 | (c & 0x3F));
    }
  }
  u[k] = '\0';
  *out = (const char*)u;
  return 0;
}

/* Copies of Java arrays in scratch memory (NULL and 0 for a null array; never NULL for an
 * empty one, as kvrouter refuses NULL pointers). */
static int copy_ints(JNIEnv* env, scratch* s, jintArray a, const uint32_t** out, size_t* n) {
  *out = NULL;
  *n = 0;
  if (a == NULL) return 0;
  jsize len = (*env)->GetArrayLength(env, a);
  jint* p = (jint*)scratch_array(env, s, (size_t)len, sizeof(jint));
  if (p == NULL) return -1;
  (*env)->GetIntArrayRegion(env, a, 0, len, p);
  if ((*env)->ExceptionCheck(env)) return -1;
  *out = (const uint32_t*)p;
  *n = (size_t)len;
  return 0;
}

static int copy_longs(JNIEnv* env, scratch* s, jlongArray a, const uint64_t** out, size_t* n) {
  *out = NULL;
  *n = 0;
  if (a == NULL) return 0;
  jsize len = (*env)->GetArrayLength(env, a);
  jlong* p = (jlong*)scratch_array(env, s, (size_t)len, sizeof(jlong));
  if (p == NULL) return -1;
  (*env)->GetLongArrayRegion(env, a, 0, len, p);
  if ((*env)->ExceptionCheck(env)) return -1;
  *out = (const uint64_t*)p;
  *n = (size_t)len;
  return 0;
}

/* A prompt's tokens for one library call. Calls that take only the index's lock (overlap
 * scores) read the Java array in place with GetPrimitiveArrayCritical: no copy (an 8,192-token
 * prompt is 32 KiB) and no allocation. Every call that takes the router's admission lock copies
 * it, previews and potential loads included: a booking thread holds that lock while it calls the
 * replica publisher in Java, whose allocations may need a collection, and a collection waits for
 * every critical region (a preview waiting in one for the lock would deadlock the process);
 * admitted calls may also wait in the admission queue. Between tokens_begin and tokens_end: the
 * library call only. A prompt given hashed (prompt_prepare) has no tokens: n is its length. */
typedef struct {
  jintArray array;
  size_t n;
  const uint32_t* copy; /* copied */
  void* pinned;         /* in place, between tokens_begin and tokens_end */
} tokens_in;

/* With direct != NULL the prompt is the length ints at int offset of a direct IntBuffer (native
 * order; the Java side checks both): read in place for any call, as direct memory never moves
 * (no copy, no critical region). Otherwise the array a. */
static int tokens_prepare(JNIEnv* env, scratch* s, jintArray a, jobject direct, jint offset,
                          jint length, int in_place, tokens_in* t) {
  t->array = a;
  t->copy = NULL;
  t->pinned = NULL;
  if (direct != NULL) {
    /* offset and length are the buffer's position and remaining, so within its capacity (Router
     * takes them from the buffer itself; asking the capacity again costs more JNI calls). */
    const uint32_t* base = (const uint32_t*)(*env)->GetDirectBufferAddress(env, direct);
    if (base == NULL || offset < 0 || length < 0) {
      return throw_iae(env, "kvrouter: tokens must be a direct IntBuffer");
    }
    static const uint32_t none = 0; /* kvrouter refuses NULL, even for no tokens */
    t->copy = length > 0 ? base + offset : &none;
    t->n = (size_t)length;
    return 0;
  }
  if (a == NULL) return throw_iae(env, "kvrouter: null tokens");
  if (!in_place) return copy_ints(env, s, a, &t->copy, &t->n);
  t->n = (size_t)(*env)->GetArrayLength(env, a);
  return 0;
}

/* A routing call's prompt: with hashes non-null, a prompt given hashed (the Java *Hashed
 * methods): its local hashes, one per complete block, go into o (initialised by
 * read_request_options) with KVR_REQUEST_PREHASHED, and t holds no tokens, only num_tokens, the
 * prompt's length (the library checks the one against the other). The hashes are copied for
 * every call, as tokens are for the calls taking the admission lock (see tokens_in): 8 bytes per
 * block, 4 KiB for an 8,192-token prompt in blocks of 16 (its tokens: 32 KiB). Otherwise the
 * tokens, as tokens_prepare. */
static int prompt_prepare(JNIEnv* env, scratch* s, jintArray a, jobject direct, jint offset,
                          jint length, jlongArray hashes, jlong num_tokens, int in_place,
                          kvr_request_options* o, tokens_in* t) {
  if (hashes == NULL) return tokens_prepare(env, s, a, direct, offset, length, in_place, t);
  if (num_tokens < 0) return throw_iae(env, "kvrouter: negative numTokens");
  t->array = NULL;
  t->copy = NULL;
  t->pinned = NULL;
  t->n = (size_t)num_tokens;
  if (copy_longs(env, s, hashes, &o->local_hashes, &o->num_local_hashes) != 0) return -1;
  o->flags |= KVR_REQUEST_PREHASHED;
  return 0;
}

/* The tokens into *out (NULL for a prompt given hashed); 0, or -1 with an exception pending (in
 * place: out of memory). */
static int tokens_begin(JNIEnv* env, tokens_in* t, const uint32_t** out) {
  *out = t->copy;
  if (t->copy != NULL || t->array == NULL) return 0;
  t->pinned = (*env)->GetPrimitiveArrayCritical(env, t->array, NULL);
  *out = (const uint32_t*)t->pinned;
  return t->pinned != NULL ? 0 : -1;
}

static void tokens_end(JNIEnv* env, tokens_in* t) {
  if (t->pinned == NULL) return;
  (*env)->ReleasePrimitiveArrayCritical(env, t->array, t->pinned, JNI_ABORT);
  t->pinned = NULL;
}

/* Multimodal counts: Java ints to size_t, refusing negative ones. */
static int copy_counts(JNIEnv* env, scratch* s, jintArray a, const size_t** out, size_t* n) {
  const uint32_t* ints;
  if (copy_ints(env, s, a, &ints, n) != 0) return -1;
  *out = NULL;
  if (ints == NULL) return 0;
  size_t* counts = (size_t*)scratch_array(env, s, *n, sizeof(size_t));
  if (counts == NULL) return -1;
  for (size_t i = 0; i < *n; ++i) {
    if ((int32_t)ints[i] < 0) return throw_iae(env, "kvrouter: negative multimodal count");
    counts[i] = ints[i];
  }
  *out = counts;
  return 0;
}

static int copy_bytes(JNIEnv* env, scratch* s, jbyteArray a, jint offset, jint length,
                      const void** out) {
  jbyte* p = (jbyte*)scratch_alloc(env, s, (size_t)length);
  if (p == NULL) return -1;
  (*env)->GetByteArrayRegion(env, a, offset, length, p);
  if ((*env)->ExceptionCheck(env)) return -1;
  *out = p;
  return 0;
}

/* An encoded struct of exactly `expected` values. */
static int read_scalars(JNIEnv* env, jlongArray a, jlong* out, jsize expected) {
  if (a == NULL) return throw_iae(env, "kvrouter: missing encoded struct");
  if ((*env)->GetArrayLength(env, a) != expected) {
    return throw_iae(env, "kvrouter: encoded struct of the wrong length");
  }
  (*env)->GetLongArrayRegion(env, a, 0, expected, out);
  return (*env)->ExceptionCheck(env) ? -1 : 0;
}

/* Object fields: each read, converted and its local reference dropped. */
static int field_utf8(JNIEnv* env, scratch* s, jobject obj, jfieldID f, const char** out) {
  jstring str = (jstring)(*env)->GetObjectField(env, obj, f);
  int rc = utf8(env, s, str, out);
  if (str != NULL) (*env)->DeleteLocalRef(env, str);
  return rc;
}

static int field_longs(JNIEnv* env, scratch* s, jobject obj, jfieldID f, const uint64_t** out,
                       size_t* n) {
  jlongArray a = (jlongArray)(*env)->GetObjectField(env, obj, f);
  int rc = copy_longs(env, s, a, out, n);
  if (a != NULL) (*env)->DeleteLocalRef(env, a);
  return rc;
}

static int field_ints(JNIEnv* env, scratch* s, jobject obj, jfieldID f, const uint32_t** out,
                      size_t* n) {
  jintArray a = (jintArray)(*env)->GetObjectField(env, obj, f);
  int rc = copy_ints(env, s, a, out, n);
  if (a != NULL) (*env)->DeleteLocalRef(env, a);
  return rc;
}

static int field_counts(JNIEnv* env, scratch* s, jobject obj, jfieldID f, const size_t** out,
                        size_t* n) {
  jintArray a = (jintArray)(*env)->GetObjectField(env, obj, f);
  int rc = copy_counts(env, s, a, out, n);
  if (a != NULL) (*env)->DeleteLocalRef(env, a);
  return rc;
}

static int field_scalars(JNIEnv* env, jobject obj, jfieldID f, jlong* out, jsize expected) {
  jlongArray a = (jlongArray)(*env)->GetObjectField(env, obj, f);
  int rc = read_scalars(env, a, out, expected);
  if (a != NULL) (*env)->DeleteLocalRef(env, a);
  return rc;
}

/* ---- Structs: Java to C -------------------------------------------------------------------
 * Each struct is initialised (INIT: defaults, struct_size), then takes its value fields from
 * the encoded long[] through the generated abi_decode_*, then its pointers and their counts
 * from the Java arrays and strings (the count slots of the long[] are not trusted). */

static int read_router_options(JNIEnv* env, jlongArray a, kvr_router_options* o) {
  jlong v[ABI_ROUTER_OPTIONS_LEN];
  if (INIT(env, kvr_router_options_init, o) != 0 ||
      read_scalars(env, a, v, ABI_ROUTER_OPTIONS_LEN) != 0) {
    return -1;
  }
  abi_decode_router_options(v, o);
  return 0;
}

static int read_worker_config(JNIEnv* env, jlongArray a, kvr_worker_config* c) {
  jlong v[ABI_WORKER_CONFIG_LEN];
  if (INIT(env, kvr_worker_config_init, c) != 0 ||
      read_scalars(env, a, v, ABI_WORKER_CONFIG_LEN) != 0) {
    return -1;
  }
  abi_decode_worker_config(v, c);
  return 0;
}

static int read_disagg_options(JNIEnv* env, jlongArray a, kvr_disagg_options* o) {
  jlong v[ABI_DISAGG_OPTIONS_LEN];
  if (INIT(env, kvr_disagg_options_init, o) != 0 ||
      read_scalars(env, a, v, ABI_DISAGG_OPTIONS_LEN) != 0) {
    return -1;
  }
  abi_decode_disagg_options(v, o);
  return 0;
}

static int read_ingest_options(JNIEnv* env, jlongArray a, kvr_ingest_options* o) {
  jlong v[ABI_INGEST_OPTIONS_LEN];
  if (INIT(env, kvr_ingest_options_init, o) != 0 ||
      read_scalars(env, a, v, ABI_INGEST_OPTIONS_LEN) != 0) {
    return -1;
  }
  abi_decode_ingest_options(v, o);
  return 0;
}

/* A preview's signals handed back to kvr_plan_route. */
static int read_route_signals(JNIEnv* env, jlongArray a, kvr_route_signals* r) {
  jlong v[ABI_ROUTE_SIGNALS_LEN];
  if (INIT(env, kvr_route_signals_init, r) != 0 ||
      read_scalars(env, a, v, ABI_ROUTE_SIGNALS_LEN) != 0) {
    return -1;
  }
  abi_decode_route_signals(v, r);
  return 0;
}

/* A RequestOptions object (null: the defaults). */
static int read_request_options(JNIEnv* env, scratch* s, jobject obj, kvr_request_options* o) {
  if (INIT(env, kvr_request_options_init, o) != 0) return -1;
  if (obj == NULL) return 0;
  jlong v[ABI_REQUEST_OPTIONS_LEN];
  if (field_scalars(env, obj, g_request.scalars, v, ABI_REQUEST_OPTIONS_LEN) != 0) return -1;
  abi_decode_request_options(v, o);
  o->num_local_hashes = 0; /* with local_hashes, from the hashes of a prompt given hashed only */
  size_t mm_hashes = 0;
  if (field_utf8(env, s, obj, g_request.request_id, &o->request_id) != 0 ||
      field_utf8(env, s, obj, g_request.lora_name, &o->lora_name) != 0 ||
      field_utf8(env, s, obj, g_request.cache_namespace, &o->cache_namespace) != 0 ||
      field_longs(env, s, obj, g_request.mm_hashes, &o->mm_hashes, &mm_hashes) != 0 ||
      field_counts(env, s, obj, g_request.mm_counts, &o->mm_counts, &o->mm_num_blocks) != 0 ||
      field_longs(env, s, obj, g_request.allowed, &o->allowed_worker_ids,
                  &o->num_allowed_worker_ids) != 0) {
    return -1;
  }
  return 0;
}

/* A RoutingHints object; returns the struct to pass (NULL for a null object). */
static int read_routing_hints(JNIEnv* env, scratch* s, jobject obj, kvr_routing_hints* h,
                              const kvr_routing_hints** pass) {
  *pass = NULL;
  if (obj == NULL) return 0;
  jlong v[ABI_ROUTING_HINTS_LEN];
  if (INIT(env, kvr_routing_hints_init, h) != 0 ||
      field_scalars(env, obj, g_hints.scalars, v, ABI_ROUTING_HINTS_LEN) != 0) {
    return -1;
  }
  abi_decode_routing_hints(v, h);
  if (field_utf8(env, s, obj, g_hints.session_id, &h->session_id) != 0) return -1;
  *pass = h;
  return 0;
}

static int read_stored_event(JNIEnv* env, scratch* s, jobject obj, kvr_stored_event* e) {
  if (obj == NULL) return throw_iae(env, "kvrouter: null event");
  jlong v[ABI_STORED_EVENT_LEN];
  if (INIT(env, kvr_stored_event_init, e) != 0 ||
      field_scalars(env, obj, g_stored.scalars, v, ABI_STORED_EVENT_LEN) != 0) {
    return -1;
  }
  abi_decode_stored_event(v, e);
  size_t num_local = 0, num_mm = 0, num_counts = 0;
  if (field_longs(env, s, obj, g_stored.block_hashes, &e->block_hashes, &e->num_blocks) != 0 ||
      field_longs(env, s, obj, g_stored.local_hashes, &e->local_hashes, &num_local) != 0 ||
      field_ints(env, s, obj, g_stored.token_ids, &e->token_ids, &e->num_tokens) != 0 ||
      field_utf8(env, s, obj, g_stored.lora_name, &e->lora_name) != 0 ||
      field_utf8(env, s, obj, g_stored.cache_namespace, &e->cache_namespace) != 0 ||
      field_longs(env, s, obj, g_stored.mm_hashes, &e->mm_hashes, &num_mm) != 0 ||
      field_counts(env, s, obj, g_stored.mm_counts, &e->mm_counts, &num_counts) != 0) {
    return -1;
  }
  /* The C struct has no lengths for these: they are num_blocks long by contract. */
  if (e->local_hashes != NULL && num_local != e->num_blocks) {
    return throw_iae(env, "kvrouter: localHashes must have one value per block");
  }
  if (e->mm_counts != NULL && num_counts != e->num_blocks) {
    return throw_iae(env, "kvrouter: multimodal counts must have one value per block");
  }
  if (e->mm_counts != NULL) {
    size_t sum = 0;
    for (size_t i = 0; i < num_counts; ++i) sum += e->mm_counts[i];
    if (sum != num_mm) {
      return throw_iae(env, "kvrouter: multimodal counts do not add up to the hashes given");
    }
  }
  return 0;
}

static int read_removed_event(JNIEnv* env, scratch* s, jobject obj, kvr_removed_event* e) {
  if (obj == NULL) return throw_iae(env, "kvrouter: null event");
  jlong v[ABI_REMOVED_EVENT_LEN];
  if (INIT(env, kvr_removed_event_init, e) != 0 ||
      field_scalars(env, obj, g_removed.scalars, v, ABI_REMOVED_EVENT_LEN) != 0) {
    return -1;
  }
  abi_decode_removed_event(v, e);
  return field_longs(env, s, obj, g_removed.block_hashes, &e->block_hashes, &e->num_blocks);
}

/* ---- Conversions: C to Java ----------------------------------------------------------------- */

/* Writes n values into a caller array of at least n. */
static int put_longs(JNIEnv* env, jlongArray out, const jlong* v, jsize n) {
  if (out == NULL || (*env)->GetArrayLength(env, out) < n) {
    return throw_iae(env, "kvrouter: result array too short");
  }
  (*env)->SetLongArrayRegion(env, out, 0, n, v);
  return (*env)->ExceptionCheck(env) ? -1 : 0;
}

static jlongArray new_longs(JNIEnv* env, const jlong* v, size_t n) {
  if (n > (size_t)INT32_MAX) {
    throw_oom(env, "kvrouter: result too large for a Java array");
    return NULL;
  }
  jlongArray a = (*env)->NewLongArray(env, (jsize)n);
  if (a == NULL) return NULL;
  (*env)->SetLongArrayRegion(env, a, 0, (jsize)n, v);
  if ((*env)->ExceptionCheck(env)) {
    (*env)->DeleteLocalRef(env, a);
    return NULL;
  }
  return a;
}

static jbyteArray new_bytes(JNIEnv* env, const uint8_t* data, size_t n) {
  if (n > (size_t)INT32_MAX) {
    throw_oom(env, "kvrouter: buffer too large for a Java array");
    return NULL;
  }
  jbyteArray a = (*env)->NewByteArray(env, (jsize)n);
  if (a == NULL) return NULL;
  (*env)->SetByteArrayRegion(env, a, 0, (jsize)n, (const jbyte*)data);
  if ((*env)->ExceptionCheck(env)) {
    (*env)->DeleteLocalRef(env, a);
    return NULL;
  }
  return a;
}

/* A kvr_buffer's bytes as a Java array; frees the buffer. */
static jbyteArray take_buffer(JNIEnv* env, kvr_buffer* buffer) {
  jbyteArray a = new_bytes(env, kvr_buffer_data(buffer), kvr_buffer_size(buffer));
  kvr_buffer_free(buffer);
  return a;
}

/* ---- Loading -------------------------------------------------------------------------------- */

static jclass global_class(JNIEnv* env, const char* name) {
  jclass local = (*env)->FindClass(env, name);
  if (local == NULL) return NULL;
  jclass global = (jclass)(*env)->NewGlobalRef(env, local);
  (*env)->DeleteLocalRef(env, local);
  return global;
}

JNIEXPORT jint JNICALL JNI_OnLoad(JavaVM* vm, void* reserved) {
  (void)reserved;
  JNIEnv* env = NULL;
  if ((*vm)->GetEnv(vm, (void**)&env, JNI_VERSION_1_8) != JNI_OK) return JNI_ERR;
  g_vm = vm;
  g_exception = global_class(env, "io/kvrouter/KvRouterException");
  if (g_exception == NULL) return JNI_ERR;
  g_exception_init = (*env)->GetMethodID(env, g_exception, "<init>", "(ILjava/lang/String;)V");
  if (g_exception_init == NULL) return JNI_ERR;
  g_string = global_class(env, "java/lang/String");
  if (g_string == NULL) return JNI_ERR;
  g_string_init = (*env)->GetMethodID(env, g_string, "<init>", "([BLjava/lang/String;)V");
  if (g_string_init == NULL) return JNI_ERR;
  jstring name = (*env)->NewStringUTF(env, "UTF-8");
  if (name == NULL) return JNI_ERR;
  g_utf8 = (jstring)(*env)->NewGlobalRef(env, name);
  (*env)->DeleteLocalRef(env, name);
  if (g_utf8 == NULL) return JNI_ERR;
  return JNI_VERSION_1_8;
}

JNIEXPORT void JNICALL JNI_OnUnload(JavaVM* vm, void* reserved) {
  (void)reserved;
  JNIEnv* env = NULL;
  if ((*vm)->GetEnv(vm, (void**)&env, JNI_VERSION_1_8) != JNI_OK) return;
  if (g_exception != NULL) (*env)->DeleteGlobalRef(env, g_exception);
  if (g_string != NULL) (*env)->DeleteGlobalRef(env, g_string);
  if (g_utf8 != NULL) (*env)->DeleteGlobalRef(env, g_utf8);
  g_exception = NULL;
  g_string = NULL;
  g_utf8 = NULL;
}

/* The fields of the option and event classes, looked up once the library is loaded (not in
 * JNI_OnLoad: looking a field up initialises its class). */
static jfieldID field(JNIEnv* env, jclass cls, const char* name, const char* sig) {
  if ((*env)->ExceptionCheck(env)) return NULL;
  return (*env)->GetFieldID(env, cls, name, sig);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_initIds(JNIEnv* env, jclass cls) {
  (void)cls;
  static const char* const kString = "Ljava/lang/String;";
  jclass c = (*env)->FindClass(env, "io/kvrouter/RequestOptions");
  if (c == NULL) return;
  g_request.scalars = field(env, c, "scalars", "[J");
  g_request.request_id = field(env, c, "requestId", kString);
  g_request.lora_name = field(env, c, "loraName", kString);
  g_request.cache_namespace = field(env, c, "cacheNamespace", kString);
  g_request.mm_hashes = field(env, c, "mmHashes", "[J");
  g_request.mm_counts = field(env, c, "mmCounts", "[I");
  g_request.allowed = field(env, c, "allowedWorkerIds", "[J");
  (*env)->DeleteLocalRef(env, c);
  if ((*env)->ExceptionCheck(env)) return;

  c = (*env)->FindClass(env, "io/kvrouter/RoutingHints");
  if (c == NULL) return;
  g_hints.scalars = field(env, c, "scalars", "[J");
  g_hints.session_id = field(env, c, "sessionId", kString);
  (*env)->DeleteLocalRef(env, c);
  if ((*env)->ExceptionCheck(env)) return;

  c = (*env)->FindClass(env, "io/kvrouter/StoredEvent");
  if (c == NULL) return;
  g_stored.scalars = field(env, c, "scalars", "[J");
  g_stored.block_hashes = field(env, c, "blockHashes", "[J");
  g_stored.local_hashes = field(env, c, "localHashes", "[J");
  g_stored.token_ids = field(env, c, "tokenIds", "[I");
  g_stored.lora_name = field(env, c, "loraName", kString);
  g_stored.cache_namespace = field(env, c, "cacheNamespace", kString);
  g_stored.mm_hashes = field(env, c, "mmHashes", "[J");
  g_stored.mm_counts = field(env, c, "mmCounts", "[I");
  (*env)->DeleteLocalRef(env, c);
  if ((*env)->ExceptionCheck(env)) return;

  c = (*env)->FindClass(env, "io/kvrouter/RemovedEvent");
  if (c == NULL) return;
  g_removed.scalars = field(env, c, "scalars", "[J");
  g_removed.block_hashes = field(env, c, "blockHashes", "[J");
  (*env)->DeleteLocalRef(env, c);
  if ((*env)->ExceptionCheck(env)) return;

  c = (*env)->FindClass(env, "io/kvrouter/ReplicaSink");
  if (c == NULL) return;
  g_sink_publish = (*env)->GetMethodID(env, c, "publish", "([B)V");
  (*env)->DeleteLocalRef(env, c);
}

/* ---- Library -------------------------------------------------------------------------------- */

JNIEXPORT jint JNICALL Java_io_kvrouter_Native_version(JNIEnv* env, jclass cls) {
  (void)env;
  (void)cls;
  return (jint)kvr_version();
}

JNIEXPORT jstring JNICALL Java_io_kvrouter_Native_versionString(JNIEnv* env, jclass cls) {
  (void)cls;
  return new_string(env, kvr_version_string());
}

JNIEXPORT jint JNICALL Java_io_kvrouter_Native_headerVersion(JNIEnv* env, jclass cls) {
  (void)env;
  (void)cls;
  return (jint)KVR_VERSION_NUMBER;
}

JNIEXPORT jstring JNICALL Java_io_kvrouter_Native_statusStr(JNIEnv* env, jclass cls, jint status) {
  (void)cls;
  return new_string(env, kvr_status_str((kvr_status)status));
}

JNIEXPORT jint JNICALL Java_io_kvrouter_Native_tierFromMedium(JNIEnv* env, jclass cls,
                                                              jstring medium) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  const char* m = NULL;
  jint tier = 0;
  if (utf8(env, &s, medium, &m) == 0) tier = (jint)kvr_tier_from_medium(m);
  scratch_free(&s);
  return tier;
}

/* Native.<java>Defaults(): the library's defaults of one struct (its _init at the glue's size),
 * encoded in its generated slots: what the Java builders start from. */
#define DEFAULTS_NATIVE(java, codec, len)                                                          \
  JNIEXPORT jlongArray JNICALL Java_io_kvrouter_Native_##java##Defaults(JNIEnv* env, jclass cls) { \
    (void)cls;                                                                                     \
    kvr_##codec c;                                                                                 \
    if (INIT(env, kvr_##codec##_init, &c) != 0) return NULL;                                       \
    jlong v[len];                                                                                  \
    abi_encode_##codec(&c, v);                                                                     \
    return new_longs(env, v, len);                                                                 \
  }
DEFAULTS_NATIVE(routerOptions, router_options, ABI_ROUTER_OPTIONS_LEN)
DEFAULTS_NATIVE(workerConfig, worker_config, ABI_WORKER_CONFIG_LEN)
DEFAULTS_NATIVE(requestOptions, request_options, ABI_REQUEST_OPTIONS_LEN)
DEFAULTS_NATIVE(routingHints, routing_hints, ABI_ROUTING_HINTS_LEN)
DEFAULTS_NATIVE(disaggOptions, disagg_options, ABI_DISAGG_OPTIONS_LEN)
DEFAULTS_NATIVE(ingestOptions, ingest_options, ABI_INGEST_OPTIONS_LEN)
DEFAULTS_NATIVE(engineWorker, engine_worker, ABI_ENGINE_WORKER_LEN)
DEFAULTS_NATIVE(jetstreamSource, jetstream_source, ABI_JETSTREAM_SOURCE_LEN)
DEFAULTS_NATIVE(storedEvent, stored_event, ABI_STORED_EVENT_LEN)
DEFAULTS_NATIVE(removedEvent, removed_event, ABI_REMOVED_EVENT_LEN)
#undef DEFAULTS_NATIVE

/* ---- Hashing -------------------------------------------------------------------------------- */

JNIEXPORT jlongArray JNICALL Java_io_kvrouter_Native_computeBlockHashes(
    JNIEnv* env, jclass cls, jintArray tokens, jint block_size, jboolean eagle, jstring lora,
    jstring ns, jlongArray mm_hashes, jintArray mm_counts) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  jlongArray result = NULL;
  kvr_hash_options opts;
  if (INIT(env, kvr_hash_options_init, &opts) != 0) goto done;
  opts.flags = eagle ? KVR_HASH_EAGLE : 0;
  size_t num_mm = 0;
  if (utf8(env, &s, lora, &opts.lora_name) != 0 || utf8(env, &s, ns, &opts.cache_namespace) != 0 ||
      copy_longs(env, &s, mm_hashes, &opts.mm_hashes, &num_mm) != 0 ||
      copy_counts(env, &s, mm_counts, &opts.mm_counts, &opts.mm_num_blocks) != 0) {
    goto done;
  }
  if (tokens == NULL) {
    throw_iae(env, "kvrouter: null tokens");
    goto done;
  }
  const size_t num_tokens = (size_t)(*env)->GetArrayLength(env, tokens);
  /* The output is known in advance: one hash per complete block (allocated before the
   * critical section, which allows no JNI call). */
  size_t cap = block_size > 0 ? num_tokens / (uint32_t)block_size + 1 : 1;
  for (int attempt = 0; attempt < 2; ++attempt) {
    uint64_t* out = (uint64_t*)scratch_array(env, &s, cap, sizeof(uint64_t));
    if (out == NULL) goto done;
    size_t len = 0;
    kvr_error* err = NULL;
    void* p = (*env)->GetPrimitiveArrayCritical(env, tokens, NULL);
    if (p == NULL) goto done; /* OutOfMemoryError pending */
    kvr_status st = kvr_compute_block_hashes((const uint32_t*)p, num_tokens, (uint32_t)block_size,
                                             &opts, out, cap, &len, &err);
    (*env)->ReleasePrimitiveArrayCritical(env, tokens, p, JNI_ABORT);
    if (st == KVR_BUFFER_TOO_SMALL && attempt == 0) {
      kvr_error_free(err);
      cap = len;
      continue;
    }
    if (check(env, st, &err) != 0) goto done;
    result = new_longs(env, (const jlong*)out, len);
    break;
  }
done:
  scratch_free(&s);
  return result;
}

JNIEXPORT jlongArray JNICALL Java_io_kvrouter_Native_computeSequenceHashes(JNIEnv* env, jclass cls,
                                                                           jlongArray local) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  jlongArray result = NULL;
  if (local == NULL) {
    throw_iae(env, "kvrouter: null hashes");
    goto done;
  }
  const size_t n = (size_t)(*env)->GetArrayLength(env, local);
  uint64_t* out = (uint64_t*)scratch_array(env, &s, n, sizeof(uint64_t));
  if (out == NULL) goto done;
  size_t len = 0;
  kvr_error* err = NULL;
  void* p = (*env)->GetPrimitiveArrayCritical(env, local, NULL);
  if (p == NULL) goto done;
  kvr_status st = kvr_compute_sequence_hashes((const uint64_t*)p, n, out, n, &len, &err);
  (*env)->ReleasePrimitiveArrayCritical(env, local, p, JNI_ABORT);
  if (check(env, st, &err) != 0) goto done;
  result = new_longs(env, (const jlong*)out, len);
done:
  scratch_free(&s);
  return result;
}

/* ---- Router --------------------------------------------------------------------------------- */

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_routerNew(JNIEnv* env, jclass cls,
                                                          jlongArray options) {
  (void)cls;
  kvr_router_options o;
  if (read_router_options(env, options, &o) != 0) return 0;
  kvr_router* router = NULL;
  kvr_error* err = NULL;
  if (check(env, kvr_router_new(&o, &router, &err), &err) != 0) return 0;
  return HANDLE(router);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_routerFree(JNIEnv* env, jclass cls, jlong r) {
  (void)env;
  (void)cls;
  kvr_router_free(ROUTER(r));
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_addWorker(JNIEnv* env, jclass cls, jlong r,
                                                         jlongArray config) {
  (void)cls;
  kvr_worker_config c;
  if (read_worker_config(env, config, &c) != 0) return;
  kvr_error* err = NULL;
  check(env, kvr_router_add_worker(ROUTER(r), &c, &err), &err);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_updateWorker(JNIEnv* env, jclass cls, jlong r,
                                                            jlongArray config) {
  (void)cls;
  kvr_worker_config c;
  if (read_worker_config(env, config, &c) != 0) return;
  kvr_error* err = NULL;
  check(env, kvr_router_update_worker(ROUTER(r), &c, &err), &err);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_removeWorker(JNIEnv* env, jclass cls, jlong r,
                                                            jlong worker_id) {
  (void)cls;
  kvr_error* err = NULL;
  check(env, kvr_router_remove_worker(ROUTER(r), (uint64_t)worker_id, &err), &err);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_applyStored(JNIEnv* env, jclass cls, jlong r,
                                                           jobject event) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  kvr_stored_event e;
  if (read_stored_event(env, &s, event, &e) == 0) {
    kvr_error* err = NULL;
    check(env, kvr_router_apply_stored(ROUTER(r), &e, &err), &err);
  }
  scratch_free(&s);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_applyRemoved(JNIEnv* env, jclass cls, jlong r,
                                                            jobject event) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  kvr_removed_event e;
  if (read_removed_event(env, &s, event, &e) == 0) {
    kvr_error* err = NULL;
    check(env, kvr_router_apply_removed(ROUTER(r), &e, &err), &err);
  }
  scratch_free(&s);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_applyCleared(JNIEnv* env, jclass cls, jlong r,
                                                            jlong worker_id, jint dp_rank,
                                                            jlong event_id) {
  (void)cls;
  kvr_error* err = NULL;
  check(env,
        kvr_router_apply_cleared(ROUTER(r), (uint64_t)worker_id, (uint32_t)dp_rank,
                                 (uint64_t)event_id, &err),
        &err);
}

/* The bytes [offset, offset + length) of a byte array, checked (Java checks them too). */
static int check_range(JNIEnv* env, jbyteArray a, jint offset, jint length) {
  if (a == NULL) return throw_iae(env, "kvrouter: null buffer");
  jsize n = (*env)->GetArrayLength(env, a);
  if (offset < 0 || length < 0 || offset > n - length) {
    throw_named(env, "java/lang/IndexOutOfBoundsException", "kvrouter: buffer range");
    return -1;
  }
  return 0;
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_applyEventBatch(JNIEnv* env, jclass cls, jlong r,
                                                               jbyteArray data, jint offset,
                                                               jint length) {
  (void)cls;
  if (check_range(env, data, offset, length) != 0) return;
  kvr_error* err = NULL;
  uint8_t* p = (uint8_t*)(*env)->GetPrimitiveArrayCritical(env, data, NULL);
  if (p == NULL) return;
  kvr_status st = kvr_router_apply_event_batch(ROUTER(r), p + offset, (size_t)length, &err);
  (*env)->ReleasePrimitiveArrayCritical(env, data, p, JNI_ABORT);
  check(env, st, &err);
}

/* ---- Router replicas ------------------------------------------------------------------------ */

/* What kvr_router_set_replica_publisher's user_data points to: the Java sink to call. Freed by
 * Native.freeReplicaContext, only once the library guarantees the callback no longer runs
 * (after the publisher was replaced or cleared, or the router freed). */
typedef struct replica_context {
  jobject sink; /* global reference to an io.kvrouter.ReplicaSink */
} replica_context;

/* The publish callback: runs on the thread that changed a booking (a Java thread inside a
 * router call, or a thread of the library's own, which is attached for the call), under the
 * router's lock. Hands a copy of the bytes to the sink, which never throws; an exception that
 * escapes anyway (OutOfMemoryError) is cleared, so the caller's JNI frame stays clean. */
static void replica_publish(void* user_data, const void* data, size_t size) {
  replica_context* ctx = (replica_context*)user_data;
  JNIEnv* env = NULL;
  int attached = 0;
  jint rc = (*g_vm)->GetEnv(g_vm, (void**)&env, JNI_VERSION_1_8);
  if (rc == JNI_EDETACHED) {
    if ((*g_vm)->AttachCurrentThreadAsDaemon(g_vm, (void**)&env, NULL) != JNI_OK) return;
    attached = 1;
  } else if (rc != JNI_OK) {
    return;
  }
  /* The glue never calls the library with an exception pending; if one is (a bug), Java
   * cannot be called: the change is dropped rather than the exception lost. */
  if (!(*env)->ExceptionCheck(env) && size <= (size_t)INT32_MAX) {
    jbyteArray bytes = (*env)->NewByteArray(env, (jsize)size);
    if (bytes != NULL) {
      (*env)->SetByteArrayRegion(env, bytes, 0, (jsize)size, (const jbyte*)data);
      if (!(*env)->ExceptionCheck(env)) {
        (*env)->CallVoidMethod(env, ctx->sink, g_sink_publish, bytes);
      }
      (*env)->DeleteLocalRef(env, bytes);
    }
    if ((*env)->ExceptionCheck(env)) (*env)->ExceptionClear(env);
  }
  if (attached) (*g_vm)->DetachCurrentThread(g_vm);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_freeReplicaContext(JNIEnv* env, jclass cls,
                                                                  jlong context) {
  (void)cls;
  replica_context* ctx = (replica_context*)(intptr_t)context;
  if (ctx == NULL) return;
  (*env)->DeleteGlobalRef(env, ctx->sink);
  free(ctx);
}

/* Installs `sink` (null: stops publishing) and returns the new context (0 for none). The
 * caller frees the previous context once this returned: the library guarantees the previous
 * callback is then not running and will not run again. */
JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_setReplicaPublisher(JNIEnv* env, jclass cls,
                                                                    jlong r, jstring replica_id,
                                                                    jobject sink) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  replica_context* ctx = NULL;
  const char* id = NULL;
  if (utf8(env, &s, replica_id, &id) != 0) goto done;
  if (sink != NULL) {
    ctx = (replica_context*)malloc(sizeof *ctx);
    if (ctx == NULL) {
      throw_oom(env, "kvrouter: out of native memory");
      goto done;
    }
    ctx->sink = (*env)->NewGlobalRef(env, sink);
    if (ctx->sink == NULL) {
      free(ctx);
      ctx = NULL;
      throw_oom(env, "kvrouter: no global reference for the replica publisher");
      goto done;
    }
  }
  kvr_error* err = NULL;
  kvr_status st = kvr_router_set_replica_publisher(ROUTER(r), id,
                                                   ctx != NULL ? replica_publish : NULL, ctx, &err);
  if (check(env, st, &err) != 0 && ctx != NULL) { /* not installed: never called */
    (*env)->DeleteGlobalRef(env, ctx->sink);
    free(ctx);
    ctx = NULL;
  }
done:
  scratch_free(&s);
  return HANDLE(ctx);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_applyReplicaEvent(JNIEnv* env, jclass cls, jlong r,
                                                                 jbyteArray data, jint offset,
                                                                 jint length) {
  (void)cls;
  if (check_range(env, data, offset, length) != 0) return;
  scratch s;
  scratch_init(&s);
  const void* bytes = NULL;
  /* Copied, not critical: a replica's free may admit a queued request here, whose booking is
   * published through the callback, into Java. */
  if (copy_bytes(env, &s, data, offset, length, &bytes) == 0) {
    kvr_error* err = NULL;
    check(env, kvr_router_apply_replica_event(ROUTER(r), bytes, (size_t)length, &err), &err);
  }
  scratch_free(&s);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_replicaHeartbeat(JNIEnv* env, jclass cls, jlong r,
                                                                jint interval_ms) {
  (void)cls;
  kvr_error* err = NULL;
  /* The heartbeat is published through the callback, into Java, on this thread. A negative
   * interval becomes one above the maximum, which the library refuses. */
  check(env, kvr_router_replica_heartbeat(ROUTER(r), (uint32_t)interval_ms, &err), &err);
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_expireReplicas(JNIEnv* env, jclass cls, jlong r,
                                                               jdouble timeout_seconds) {
  (void)cls;
  size_t expired = 0;
  kvr_error* err = NULL;
  /* A dropped replica's frees may admit queued requests, whose bookings are published. */
  check(env, kvr_router_expire_replicas(ROUTER(r), timeout_seconds, &expired, &err), &err);
  return (jlong)expired;
}

JNIEXPORT jlongArray JNICALL Java_io_kvrouter_Native_findBestMatch(
    JNIEnv* env, jclass cls, jlong r, jintArray tokens, jobject direct, jint offset, jint length,
    jlongArray hashes, jlong num_tokens, jobject options, jint max_candidates, jlongArray out) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  jlongArray result = NULL;
  tokens_in t;
  kvr_request_options o;
  /* An int[] prompt is copied, for previews too: every decision takes the router's admission
   * lock (see tokens_in). */
  if (read_request_options(env, &s, options, &o) != 0 ||
      prompt_prepare(env, &s, tokens, direct, offset, length, hashes, num_tokens, 0, &o, &t) != 0) {
    goto done;
  }
  const size_t cap = max_candidates > 0 ? (size_t)max_candidates : 0;
  kvr_candidate* candidates = NULL;
  if (cap > 0) {
    candidates = (kvr_candidate*)scratch_array(env, &s, cap, sizeof(kvr_candidate));
    if (candidates == NULL) goto done;
  }
  kvr_route_result rr;
  if (INIT(env, kvr_route_result_init, &rr) != 0) goto done;
  size_t total = 0;
  kvr_error* err = NULL;
  const uint32_t* p;
  if (tokens_begin(env, &t, &p) != 0) goto done;
  /* No options go as NULL, as a C caller passes them: the library then reads and checks none (a
   * prompt given hashed is in the options). */
  kvr_status st =
      kvr_find_best_match(ROUTER(r), p, t.n, options == NULL && hashes == NULL ? NULL : &o, &rr,
                          candidates, cap, &total, &err);
  tokens_end(env, &t);
  if (check(env, st, &err) != 0) goto done;
  jlong v[ROUTE_RESULT_OUT_LEN];
  abi_encode_route_result(&rr, v);
  v[ROUTE_RESULT_TOTAL_CANDIDATES] = (jlong)total;
  if (put_longs(env, out, v, ROUTE_RESULT_OUT_LEN) != 0) goto done;
  if (cap > 0) {
    const size_t k = total < cap ? total : cap;
    jlong* flat = (jlong*)scratch_array(env, &s, k, sizeof(jlong) * ABI_CANDIDATE_LEN);
    if (flat == NULL) goto done;
    for (size_t i = 0; i < k; ++i)
      abi_encode_candidate(&candidates[i], flat + i * ABI_CANDIDATE_LEN);
    result = new_longs(env, flat, k * ABI_CANDIDATE_LEN);
  }
done:
  scratch_free(&s);
  return result;
}

/* Native.findBestMatchSimple: findBestMatch for options that set nothing but flags and the
 * strings (RequestOptions.simpleFlags), given as arguments: no RequestOptions fields to read,
 * no candidates. The usual admitted call (an id, perhaps a LoRA name) costs the crossing, the
 * strings' conversion and, for an int[] prompt, its copy (a preview's too: see tokens_in); a
 * direct IntBuffer is read in place. */
JNIEXPORT void JNICALL Java_io_kvrouter_Native_findBestMatchSimple(
    JNIEnv* env, jclass cls, jlong r, jintArray tokens, jobject direct, jint offset, jint length,
    jlongArray hashes, jlong num_tokens, jint flags, jstring id, jint id_n, jstring lora,
    jint lora_n, jstring ns, jint ns_n, jlongArray out) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  tokens_in t;
  kvr_request_options o;
  kvr_route_result rr;
  if (INIT(env, kvr_request_options_init, &o) != 0 || INIT(env, kvr_route_result_init, &rr) != 0) {
    goto done;
  }
  o.flags = (uint32_t)flags;
  if (utf8_n(env, &s, id, id_n, &o.request_id) != 0 ||
      utf8_n(env, &s, lora, lora_n, &o.lora_name) != 0 ||
      utf8_n(env, &s, ns, ns_n, &o.cache_namespace) != 0 ||
      prompt_prepare(env, &s, tokens, direct, offset, length, hashes, num_tokens, 0, &o, &t) != 0) {
    goto done;
  }
  kvr_error* err = NULL;
  size_t total = 0;
  const uint32_t* p;
  if (tokens_begin(env, &t, &p) != 0) goto done;
  kvr_status st = kvr_find_best_match(ROUTER(r), p, t.n, &o, &rr, NULL, 0, &total, &err);
  tokens_end(env, &t);
  if (check(env, st, &err) != 0) goto done;
  jlong v[ROUTE_RESULT_OUT_LEN];
  abi_encode_route_result(&rr, v);
  v[ROUTE_RESULT_TOTAL_CANDIDATES] = (jlong)total;
  put_longs(env, out, v, ROUTE_RESULT_OUT_LEN);
done:
  scratch_free(&s);
}

/* The C side of the overhead benchmark (Native.benchChunk): the same calls as the binding's,
 * made from a loop in C in the same process, so that the difference is the binding's cost. */
JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_benchChunk(JNIEnv* env, jclass cls, jlong r,
                                                           jint op, jintArray tokens, jint nq,
                                                           jint qlen, jbyteArray ids, jint stride,
                                                           jint nids, jint iters) {
  (void)cls;
  jsize nt = (*env)->GetArrayLength(env, tokens), nb = (*env)->GetArrayLength(env, ids);
  if (nq <= 0 || qlen <= 0 || nids <= 0 || stride <= 0 || (jlong)nq * qlen > nt ||
      (jlong)nids * stride > nb) {
    throw_iae(env, "kvrouter: benchChunk: bad sizes");
    return -1;
  }
  uint32_t* t = (uint32_t*)malloc((size_t)nt * sizeof(uint32_t));
  char* id = (char*)malloc((size_t)nb);
  jlong ns = -1;
  if (t == NULL || id == NULL) goto done;
  (*env)->GetIntArrayRegion(env, tokens, 0, nt, (jint*)t);
  (*env)->GetByteArrayRegion(env, ids, 0, nb, (jbyte*)id);
  kvr_request_options opts;
  kvr_request_options_init(&opts, sizeof opts);
  opts.flags = KVR_REQUEST_ADMIT;
  struct timespec start, end;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (jint i = 0; i < iters; ++i) {
    const char* rid = id + (size_t)(i % nids) * (size_t)stride;
    const uint32_t* p = t + (size_t)(i % nq) * (size_t)qlen;
    kvr_status st;
    if (op == 0 || op == 1) {
      kvr_route_result rr;
      kvr_route_result_init(&rr, sizeof rr);
      opts.request_id = rid;
      st = kvr_find_best_match(ROUTER(r), p, (size_t)qlen, op == 1 ? &opts : NULL, &rr, NULL, 0,
                               NULL, NULL);
      if (st == KVR_OK && op == 1) st = kvr_router_free_request(ROUTER(r), rid, NULL);
    } else {
      st = kvr_router_mark_prefill_completed(ROUTER(r), rid, NULL);
      if (st == KVR_OK) st = kvr_router_free_request(ROUTER(r), rid, NULL);
    }
    if (st != KVR_OK) goto done;
  }
  clock_gettime(CLOCK_MONOTONIC, &end);
  ns = (jlong)(end.tv_sec - start.tv_sec) * 1000000000 + (end.tv_nsec - start.tv_nsec);
done:
  free(t);
  free(id);
  return ns;
}

/* ---- The Java 22+ path (src/main/java22/io/kvrouter/HotPath.java) ------------------------- */

/* Native.ffmTable: what the java.lang.foreign path of the hot calls needs from this library, in
 * the order of HotPath's T_* constants: the addresses of the C functions it calls and the sizes
 * and field offsets of the structs it fills and reads, as this glue was compiled (so the FFM path
 * states no layout of its own). The functions are this glue's own copy of libkvrouter (linked in
 * statically, not exported: see kvrouter_jni.map) or, linked shared, the libkvrouter.so it uses:
 * the same code the JNI calls run, on the same router objects. */
JNIEXPORT jlongArray JNICALL Java_io_kvrouter_Native_ffmTable(JNIEnv* env, jclass cls) {
  (void)cls;
#define FN(f) ((jlong)(intptr_t)(f))
  const jlong v[] = {
      FN(kvr_find_best_match),
      FN(kvr_preview_route),
      FN(kvr_router_free_request),
      FN(kvr_router_mark_prefill_completed),
      FN(kvr_request_options_init),
      FN(kvr_route_result_init),
      FN(kvr_route_signals_init),
      sizeof(kvr_request_options),
      offsetof(kvr_request_options, flags),
      offsetof(kvr_request_options, request_id),
      offsetof(kvr_request_options, lora_name),
      offsetof(kvr_request_options, cache_namespace),
      sizeof(kvr_route_result),
      offsetof(kvr_route_result, dp_rank),
      offsetof(kvr_route_result, worker_id),
      offsetof(kvr_route_result, prompt_blocks),
      offsetof(kvr_route_result, device_overlap_blocks),
      offsetof(kvr_route_result, effective_overlap_blocks),
      offsetof(kvr_route_result, cached_tokens),
      offsetof(kvr_route_result, prompt_tokens),
      offsetof(kvr_route_result, cost),
      offsetof(kvr_route_result, booked),
      offsetof(kvr_route_result, queued),
      sizeof(kvr_route_signals),
      offsetof(kvr_route_signals, dp_rank),
      offsetof(kvr_route_signals, worker_id),
      offsetof(kvr_route_signals, overlap_blocks),
      offsetof(kvr_route_signals, prompt_blocks),
      offsetof(kvr_route_signals, cached_tokens),
      offsetof(kvr_route_signals, potential_decode_blocks),
      offsetof(kvr_route_signals, total_kv_blocks),
      offsetof(kvr_route_signals, cost),
      offsetof(kvr_route_signals, prompt_tokens),
      offsetof(kvr_route_signals, booked),
      offsetof(kvr_route_signals, moved),
      offsetof(kvr_route_signals, queued),
      /* A prompt given hashed (KVR_REQUEST_PREHASHED): kvr_request_options' hashes. */
      offsetof(kvr_request_options, local_hashes),
      offsetof(kvr_request_options, num_local_hashes),
  };
#undef FN
  return new_longs(env, v, sizeof v / sizeof v[0]);
}

/* Native.throwStatus: a failed FFM call's status and error object (or 0) become the exception
 * the JNI calls throw (throw_status), which frees the error. */
JNIEXPORT void JNICALL Java_io_kvrouter_Native_throwStatus(JNIEnv* env, jclass cls, jint status,
                                                           jlong err) {
  (void)cls;
  throw_status(env, (kvr_status)status, (kvr_error*)(intptr_t)err);
}

/* Results that grow: start with a small buffer, retry with the count the library asks for
 * (with room to spare, as workers may be added meanwhile), at most a few times. */
#define GROW_ATTEMPTS 8
#define INITIAL_RANKS 8

/* Rows the last per-rank query on this thread returned: the next one starts with room for as
 * many, as the library walks the index before it can say a buffer was short. */
static _Thread_local size_t last_rank_rows = INITIAL_RANKS;

static size_t rank_rows_hint(void) {
  return last_rank_rows > INITIAL_RANKS ? last_rank_rows : INITIAL_RANKS;
}

/* Overlap rows as one flat array of Abi.Overlap.LEN slots each; NULL with an exception pending
 * on failure. */
static jlongArray encode_overlaps(JNIEnv* env, scratch* s, const kvr_overlap* rows, size_t len) {
  jlong* flat = (jlong*)scratch_array(env, s, len, sizeof(jlong) * ABI_OVERLAP_LEN);
  if (flat == NULL) return NULL;
  for (size_t i = 0; i < len; ++i) abi_encode_overlap(&rows[i], flat + i * ABI_OVERLAP_LEN);
  return new_longs(env, flat, len * ABI_OVERLAP_LEN);
}

JNIEXPORT jlongArray JNICALL Java_io_kvrouter_Native_overlapScores(JNIEnv* env, jclass cls, jlong r,
                                                                   jintArray tokens,
                                                                   jlongArray hashes,
                                                                   jlong num_tokens,
                                                                   jobject options) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  jlongArray result = NULL;
  tokens_in t;
  kvr_request_options o;
  /* In place: hashing and the index's lookup take no router lock (see tokens_in). */
  if (read_request_options(env, &s, options, &o) != 0 ||
      prompt_prepare(env, &s, tokens, NULL, 0, 0, hashes, num_tokens, 1, &o, &t) != 0) {
    goto done;
  }
  size_t cap = rank_rows_hint();
  for (int attempt = 0; attempt < GROW_ATTEMPTS; ++attempt) {
    kvr_overlap* buf = (kvr_overlap*)scratch_array(env, &s, cap, sizeof(kvr_overlap));
    if (buf == NULL) goto done;
    size_t len = 0;
    kvr_error* err = NULL;
    const uint32_t* p;
    if (tokens_begin(env, &t, &p) != 0) goto done;
    kvr_status st = kvr_router_overlap_scores(ROUTER(r), p, t.n, &o, buf, cap, &len, &err);
    tokens_end(env, &t);
    if (st == KVR_BUFFER_TOO_SMALL && attempt + 1 < GROW_ATTEMPTS) {
      kvr_error_free(err);
      cap = len + len / 4 + 1;
      continue;
    }
    if (check(env, st, &err) != 0) goto done;
    last_rank_rows = len;
    result = encode_overlaps(env, &s, buf, len);
    break;
  }
done:
  scratch_free(&s);
  return result;
}

JNIEXPORT jlongArray JNICALL Java_io_kvrouter_Native_overlapScoresHashed(JNIEnv* env, jclass cls,
                                                                         jlong r, jlongArray hashes,
                                                                         jobject options) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  jlongArray result = NULL;
  const uint64_t* h = NULL;
  size_t n = 0;
  kvr_request_options o;
  if (read_request_options(env, &s, options, &o) != 0 || copy_longs(env, &s, hashes, &h, &n) != 0) {
    goto done;
  }
  size_t cap = rank_rows_hint();
  for (int attempt = 0; attempt < GROW_ATTEMPTS; ++attempt) {
    kvr_overlap* buf = (kvr_overlap*)scratch_array(env, &s, cap, sizeof(kvr_overlap));
    if (buf == NULL) goto done;
    size_t len = 0;
    kvr_error* err = NULL;
    kvr_status st = kvr_router_overlap_scores_hashed(ROUTER(r), h, n, &o, buf, cap, &len, &err);
    if (st == KVR_BUFFER_TOO_SMALL && attempt + 1 < GROW_ATTEMPTS) {
      kvr_error_free(err);
      cap = len + len / 4 + 1;
      continue;
    }
    if (check(env, st, &err) != 0) goto done;
    last_rank_rows = len;
    result = encode_overlaps(env, &s, buf, len);
    break;
  }
done:
  scratch_free(&s);
  return result;
}

/* kvr_router_find_matches: the index walk alone, one kvr_match row per rank as Abi.Match.LEN
 * slots each. The hashes are copied as for overlapScoresHashed (a null array is no hashes). */
JNIEXPORT jlongArray JNICALL Java_io_kvrouter_Native_findMatches(JNIEnv* env, jclass cls, jlong r,
                                                                 jlongArray hashes) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  jlongArray result = NULL;
  const uint64_t* h = NULL;
  size_t n = 0;
  if (copy_longs(env, &s, hashes, &h, &n) != 0) goto done;
  size_t cap = rank_rows_hint();
  for (int attempt = 0; attempt < GROW_ATTEMPTS; ++attempt) {
    kvr_match* buf = (kvr_match*)scratch_array(env, &s, cap, sizeof(kvr_match));
    if (buf == NULL) goto done;
    size_t len = 0;
    kvr_error* err = NULL;
    kvr_status st = kvr_router_find_matches(ROUTER(r), h, n, buf, cap, &len, &err);
    if (st == KVR_BUFFER_TOO_SMALL && attempt + 1 < GROW_ATTEMPTS) {
      kvr_error_free(err);
      cap = len + len / 4 + 1;
      continue;
    }
    if (check(env, st, &err) != 0) goto done;
    last_rank_rows = len;
    jlong* flat = (jlong*)scratch_array(env, &s, len, sizeof(jlong) * ABI_MATCH_LEN);
    if (flat == NULL) goto done;
    for (size_t i = 0; i < len; ++i) abi_encode_match(&buf[i], flat + i * ABI_MATCH_LEN);
    result = new_longs(env, flat, len * ABI_MATCH_LEN);
    break;
  }
done:
  scratch_free(&s);
  return result;
}

JNIEXPORT jlongArray JNICALL Java_io_kvrouter_Native_potentialLoads(JNIEnv* env, jclass cls,
                                                                    jlong r, jintArray tokens,
                                                                    jlongArray hashes,
                                                                    jlong num_tokens,
                                                                    jobject options) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  jlongArray result = NULL;
  tokens_in t;
  kvr_request_options o;
  /* Copied: the loads are read under the router's admission lock (see tokens_in). */
  if (read_request_options(env, &s, options, &o) != 0 ||
      prompt_prepare(env, &s, tokens, NULL, 0, 0, hashes, num_tokens, 0, &o, &t) != 0) {
    goto done;
  }
  size_t cap = rank_rows_hint();
  for (int attempt = 0; attempt < GROW_ATTEMPTS; ++attempt) {
    kvr_potential_load* buf =
        (kvr_potential_load*)scratch_array(env, &s, cap, sizeof(kvr_potential_load));
    if (buf == NULL) goto done;
    size_t len = 0;
    kvr_error* err = NULL;
    const uint32_t* p;
    if (tokens_begin(env, &t, &p) != 0) goto done;
    kvr_status st = kvr_router_potential_loads(ROUTER(r), p, t.n, &o, buf, cap, &len, &err);
    tokens_end(env, &t);
    if (st == KVR_BUFFER_TOO_SMALL && attempt + 1 < GROW_ATTEMPTS) {
      kvr_error_free(err);
      cap = len + len / 4 + 1;
      continue;
    }
    if (check(env, st, &err) != 0) goto done;
    last_rank_rows = len;
    jlong* flat = (jlong*)scratch_array(env, &s, len, sizeof(jlong) * ABI_POTENTIAL_LOAD_LEN);
    if (flat == NULL) goto done;
    for (size_t i = 0; i < len; ++i) {
      abi_encode_potential_load(&buf[i], flat + i * ABI_POTENTIAL_LOAD_LEN);
    }
    result = new_longs(env, flat, len * ABI_POTENTIAL_LOAD_LEN);
    break;
  }
done:
  scratch_free(&s);
  return result;
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_addRequest(JNIEnv* env, jclass cls, jlong r,
                                                          jintArray tokens, jlongArray hashes,
                                                          jlong num_tokens, jlong worker_id,
                                                          jint dp_rank, jobject options) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  tokens_in t;
  kvr_request_options o;
  /* Copied (t.copy: NULL for a prompt given hashed): a booking takes the admission lock. */
  if (read_request_options(env, &s, options, &o) == 0 &&
      prompt_prepare(env, &s, tokens, NULL, 0, 0, hashes, num_tokens, 0, &o, &t) == 0) {
    kvr_error* err = NULL;
    check(env,
          kvr_router_add_request(ROUTER(r), t.copy, t.n, (uint64_t)worker_id, (uint32_t)dp_rank, &o,
                                 &err),
          &err);
  }
  scratch_free(&s);
}

/* Calls taking (router, request id): mark, free, commit, close session. */
typedef kvr_status (*id_call)(kvr_router*, const char*, kvr_error**);

static void call_with_id(JNIEnv* env, jlong r, jstring id, id_call call) {
  scratch s;
  scratch_init(&s);
  const char* c_id = NULL;
  if (utf8(env, &s, id, &c_id) == 0) {
    kvr_error* err = NULL;
    check(env, call(ROUTER(r), c_id, &err), &err);
  }
  scratch_free(&s);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_markPrefillCompleted(JNIEnv* env, jclass cls,
                                                                    jlong r, jstring id) {
  (void)cls;
  call_with_id(env, r, id, kvr_router_mark_prefill_completed);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_recordOutput(JNIEnv* env, jclass cls, jlong r,
                                                            jstring id, jlong output_tokens) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  const char* c_id = NULL;
  if (utf8(env, &s, id, &c_id) == 0) {
    kvr_error* err = NULL;
    check(env, kvr_router_record_output(ROUTER(r), c_id, (uint64_t)output_tokens, &err), &err);
  }
  scratch_free(&s);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_freeRequest(JNIEnv* env, jclass cls, jlong r,
                                                           jstring id) {
  (void)cls;
  call_with_id(env, r, id, kvr_router_free_request);
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_closeQueue(JNIEnv* env, jclass cls, jlong r) {
  (void)cls;
  uint64_t cancelled = 0;
  kvr_error* err = NULL;
  check(env, kvr_router_close_queue(ROUTER(r), &cancelled, &err), &err);
  return (jlong)cancelled;
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_expireRequests(JNIEnv* env, jclass cls, jlong r) {
  (void)cls;
  size_t expired = 0;
  kvr_error* err = NULL;
  check(env, kvr_router_expire_requests(ROUTER(r), &expired, &err), &err);
  return (jlong)expired;
}

JNIEXPORT jbyteArray JNICALL Java_io_kvrouter_Native_snapshot(JNIEnv* env, jclass cls, jlong r) {
  (void)cls;
  kvr_buffer* buffer = NULL;
  kvr_error* err = NULL;
  if (check(env, kvr_router_snapshot(ROUTER(r), &buffer, &err), &err) != 0) return NULL;
  return take_buffer(env, buffer);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_restore(JNIEnv* env, jclass cls, jlong r,
                                                       jbyteArray data, jint offset, jint length) {
  (void)cls;
  if (check_range(env, data, offset, length) != 0) return;
  kvr_error* err = NULL;
  uint8_t* p = (uint8_t*)(*env)->GetPrimitiveArrayCritical(env, data, NULL);
  if (p == NULL) return;
  kvr_status st = kvr_router_restore(ROUTER(r), p + offset, (size_t)length, &err);
  (*env)->ReleasePrimitiveArrayCritical(env, data, p, JNI_ABORT);
  check(env, st, &err);
}

JNIEXPORT jlongArray JNICALL Java_io_kvrouter_Native_metrics(JNIEnv* env, jclass cls, jlong r) {
  (void)cls;
  kvr_metrics m;
  if (INIT(env, kvr_metrics_init, &m) != 0) return NULL;
  kvr_error* err = NULL;
  if (check(env, kvr_router_get_metrics(ROUTER(r), &m, &err), &err) != 0) return NULL;
  jlong v[ABI_METRICS_LEN];
  abi_encode_metrics(&m, v);
  return new_longs(env, v, ABI_METRICS_LEN);
}

/* Prometheus text from the router's or (router NULL) the ingest object's renderer, in a buffer
 * grown as the library asks. */
static jstring prometheus_text(JNIEnv* env, kvr_router* router, kvr_ingest* ingest) {
  scratch s;
  scratch_init(&s);
  jstring result = NULL;
  size_t cap = 4096;
  for (int attempt = 0; attempt < GROW_ATTEMPTS; ++attempt) {
    char* buf = (char*)scratch_alloc(env, &s, cap);
    if (buf == NULL) goto done;
    size_t len = 0;
    kvr_error* err = NULL;
    kvr_status st = router != NULL ? kvr_router_metrics_prometheus(router, buf, cap, &len, &err)
                                   : kvr_ingest_metrics_prometheus(ingest, buf, cap, &len, &err);
    if (st == KVR_BUFFER_TOO_SMALL && attempt + 1 < GROW_ATTEMPTS) {
      kvr_error_free(err);
      cap = len + len / 4 + 256; /* gauges and sources may appear meanwhile */
      continue;
    }
    if (check(env, st, &err) != 0) goto done;
    result = new_string(env, buf);
    break;
  }
done:
  scratch_free(&s);
  return result;
}

JNIEXPORT jstring JNICALL Java_io_kvrouter_Native_metricsPrometheus(JNIEnv* env, jclass cls,
                                                                    jlong r) {
  (void)cls;
  return prometheus_text(env, ROUTER(r), NULL);
}

JNIEXPORT jstring JNICALL Java_io_kvrouter_Native_ingestMetricsPrometheus(JNIEnv* env, jclass cls,
                                                                          jlong i) {
  (void)cls;
  return prometheus_text(env, NULL, INGEST(i));
}

/* ---- Staged routing ------------------------------------------------------------------------- */

JNIEXPORT void JNICALL Java_io_kvrouter_Native_previewRoute(JNIEnv* env, jclass cls, jlong r,
                                                            jintArray tokens, jlongArray hashes,
                                                            jlong num_tokens, jobject options,
                                                            jobject hints, jlongArray out) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  tokens_in t;
  kvr_request_options o;
  kvr_routing_hints h;
  const kvr_routing_hints* hp;
  /* Copied: a preview takes the router's admission lock (see tokens_in). */
  if (read_request_options(env, &s, options, &o) != 0 ||
      read_routing_hints(env, &s, hints, &h, &hp) != 0 ||
      prompt_prepare(env, &s, tokens, NULL, 0, 0, hashes, num_tokens, 0, &o, &t) != 0) {
    goto done;
  }
  kvr_route_signals sig;
  if (INIT(env, kvr_route_signals_init, &sig) != 0) goto done;
  kvr_error* err = NULL;
  const uint32_t* p;
  if (tokens_begin(env, &t, &p) != 0) goto done;
  kvr_status st = kvr_preview_route(ROUTER(r), p, t.n, &o, hp, &sig, &err);
  tokens_end(env, &t);
  if (check(env, st, &err) != 0) goto done;
  jlong v[ABI_ROUTE_SIGNALS_LEN];
  abi_encode_route_signals(&sig, v);
  put_longs(env, out, v, ABI_ROUTE_SIGNALS_LEN);
done:
  scratch_free(&s);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_planRoute(JNIEnv* env, jclass cls, jlong r,
                                                         jintArray tokens, jlongArray hashes,
                                                         jlong num_tokens, jobject options,
                                                         jobject hints, jlongArray previewed,
                                                         jlongArray out) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  tokens_in t;
  kvr_request_options o;
  kvr_routing_hints h;
  const kvr_routing_hints* hp;
  kvr_route_signals prev;
  /* Copied (t.copy: NULL for a prompt given hashed): a plan books, under the admission lock. */
  if (read_request_options(env, &s, options, &o) != 0 ||
      prompt_prepare(env, &s, tokens, NULL, 0, 0, hashes, num_tokens, 0, &o, &t) != 0 ||
      read_routing_hints(env, &s, hints, &h, &hp) != 0 ||
      (previewed != NULL && read_route_signals(env, previewed, &prev) != 0)) {
    goto done;
  }
  kvr_route_signals sig;
  if (INIT(env, kvr_route_signals_init, &sig) != 0) goto done;
  kvr_error* err = NULL;
  kvr_status st =
      kvr_plan_route(ROUTER(r), t.copy, t.n, &o, hp, previewed != NULL ? &prev : NULL, &sig, &err);
  if (check(env, st, &err) != 0) goto done;
  jlong v[ABI_ROUTE_SIGNALS_LEN];
  abi_encode_route_signals(&sig, v);
  put_longs(env, out, v, ABI_ROUTE_SIGNALS_LEN);
done:
  scratch_free(&s);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_commitRoute(JNIEnv* env, jclass cls, jlong r,
                                                           jstring id) {
  (void)cls;
  call_with_id(env, r, id, kvr_commit_route);
}

JNIEXPORT jboolean JNICALL Java_io_kvrouter_Native_abortRoute(JNIEnv* env, jclass cls, jlong r,
                                                              jstring id) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  const char* c_id = NULL;
  int freed = 0;
  if (utf8(env, &s, id, &c_id) == 0) {
    kvr_error* err = NULL;
    check(env, kvr_abort_route(ROUTER(r), c_id, &freed, &err), &err);
  }
  scratch_free(&s);
  return freed ? JNI_TRUE : JNI_FALSE;
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_setPlanDeadline(JNIEnv* env, jclass cls, jlong r,
                                                               jdouble seconds) {
  (void)cls;
  kvr_error* err = NULL;
  check(env, kvr_router_set_plan_deadline(ROUTER(r), seconds, &err), &err);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_setTime(JNIEnv* env, jclass cls, jlong r,
                                                       jlong nanos) {
  (void)cls;
  kvr_error* err = NULL;
  check(env, kvr_router_set_time(ROUTER(r), (int64_t)nanos, &err), &err);
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_expirePlans(JNIEnv* env, jclass cls, jlong r) {
  (void)cls;
  size_t expired = 0;
  kvr_error* err = NULL;
  check(env, kvr_router_expire_plans(ROUTER(r), &expired, &err), &err);
  return (jlong)expired;
}

JNIEXPORT jlongArray JNICALL Java_io_kvrouter_Native_sessionBinding(JNIEnv* env, jclass cls,
                                                                    jlong r, jstring session) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  jlongArray result = NULL;
  const char* c_session = NULL;
  if (utf8(env, &s, session, &c_session) != 0) goto done;
  uint64_t worker_id = 0;
  uint32_t dp_rank = 0;
  kvr_error* err = NULL;
  kvr_status st = kvr_router_session_binding(ROUTER(r), c_session, &worker_id, &dp_rank, &err);
  if (st == KVR_NOT_FOUND) { /* unbound or expired: Optional.empty() on the Java side */
    kvr_error_free(err);
    goto done;
  }
  if (check(env, st, &err) != 0) goto done;
  const jlong v[2] = {(jlong)worker_id, (jlong)dp_rank};
  result = new_longs(env, v, 2);
done:
  scratch_free(&s);
  return result;
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_closeSession(JNIEnv* env, jclass cls, jlong r,
                                                            jstring session) {
  (void)cls;
  call_with_id(env, r, session, kvr_router_close_session);
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_reclaimSessions(JNIEnv* env, jclass cls, jlong r) {
  (void)cls;
  size_t reclaimed = 0;
  kvr_error* err = NULL;
  check(env, kvr_router_reclaim_sessions(ROUTER(r), &reclaimed, &err), &err);
  return (jlong)reclaimed;
}

/* kvr_router_state_digest or kvr_router_index_digest, as a jlong (0 with an exception pending
 * on error). */
static jlong digest_of(JNIEnv* env, jlong r,
                       kvr_status (*digest)(kvr_router*, uint64_t*, kvr_error**)) {
  uint64_t value = 0;
  kvr_error* err = NULL;
  check(env, digest(ROUTER(r), &value, &err), &err);
  return (jlong)value;
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_stateDigest(JNIEnv* env, jclass cls, jlong r) {
  (void)cls;
  return digest_of(env, r, kvr_router_state_digest);
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_indexDigest(JNIEnv* env, jclass cls, jlong r) {
  (void)cls;
  return digest_of(env, r, kvr_router_index_digest);
}

/* ---- Disaggregated prefill / decode --------------------------------------------------------- */

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_disaggNew(JNIEnv* env, jclass cls,
                                                          jlongArray prefill, jlongArray decode,
                                                          jlongArray options) {
  (void)cls;
  kvr_router_options p, d;
  kvr_disagg_options o;
  if ((prefill != NULL && read_router_options(env, prefill, &p) != 0) ||
      (decode != NULL && read_router_options(env, decode, &d) != 0) ||
      (options != NULL && read_disagg_options(env, options, &o) != 0)) {
    return 0;
  }
  kvr_disagg* disagg = NULL;
  kvr_error* err = NULL;
  kvr_status st = kvr_disagg_new(prefill != NULL ? &p : NULL, decode != NULL ? &d : NULL,
                                 options != NULL ? &o : NULL, &disagg, &err);
  if (check(env, st, &err) != 0) return 0;
  return HANDLE(disagg);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_disaggFree(JNIEnv* env, jclass cls, jlong d) {
  (void)env;
  (void)cls;
  kvr_disagg_free(DISAGG(d));
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_disaggPrefillRouter(JNIEnv* env, jclass cls,
                                                                    jlong d) {
  (void)env;
  (void)cls;
  return HANDLE(kvr_disagg_prefill_router(DISAGG(d)));
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_disaggDecodeRouter(JNIEnv* env, jclass cls,
                                                                   jlong d) {
  (void)env;
  (void)cls;
  return HANDLE(kvr_disagg_decode_router(DISAGG(d)));
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_disaggRoutePrefill(JNIEnv* env, jclass cls, jlong d,
                                                                  jintArray tokens,
                                                                  jlongArray hashes,
                                                                  jlong num_tokens, jobject options,
                                                                  jobject hints, jlongArray out) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  tokens_in t;
  kvr_request_options o;
  kvr_routing_hints h;
  const kvr_routing_hints* hp;
  /* Copied (t.copy: NULL for a prompt given hashed): the pools' decisions take their locks. */
  if (read_request_options(env, &s, options, &o) != 0 ||
      prompt_prepare(env, &s, tokens, NULL, 0, 0, hashes, num_tokens, 0, &o, &t) != 0 ||
      read_routing_hints(env, &s, hints, &h, &hp) != 0) {
    goto done;
  }
  kvr_prefill_result pr;
  if (INIT(env, kvr_prefill_result_init, &pr) != 0) goto done;
  kvr_error* err = NULL;
  if (check(env, kvr_disagg_route_prefill(DISAGG(d), t.copy, t.n, &o, hp, &pr, &err), &err) != 0) {
    goto done;
  }
  jlong v[ABI_PREFILL_RESULT_LEN];
  abi_encode_prefill_result(&pr, v);
  put_longs(env, out, v, ABI_PREFILL_RESULT_LEN);
done:
  scratch_free(&s);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_disaggRouteDecode(
    JNIEnv* env, jclass cls, jlong d, jintArray tokens, jlongArray hashes, jlong num_tokens,
    jobject options, jobject hints, jboolean remote_prefill, jlongArray out) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  tokens_in t;
  kvr_request_options o;
  kvr_routing_hints h;
  const kvr_routing_hints* hp;
  /* Copied, as for disaggRoutePrefill. */
  if (read_request_options(env, &s, options, &o) != 0 ||
      prompt_prepare(env, &s, tokens, NULL, 0, 0, hashes, num_tokens, 0, &o, &t) != 0 ||
      read_routing_hints(env, &s, hints, &h, &hp) != 0) {
    goto done;
  }
  kvr_route_signals sig;
  if (INIT(env, kvr_route_signals_init, &sig) != 0) goto done;
  kvr_error* err = NULL;
  kvr_status st =
      kvr_disagg_route_decode(DISAGG(d), t.copy, t.n, &o, hp, remote_prefill ? 1 : 0, &sig, &err);
  if (check(env, st, &err) != 0) goto done;
  jlong v[ABI_ROUTE_SIGNALS_LEN];
  abi_encode_route_signals(&sig, v);
  put_longs(env, out, v, ABI_ROUTE_SIGNALS_LEN);
done:
  scratch_free(&s);
}

JNIEXPORT jboolean JNICALL Java_io_kvrouter_Native_disaggPrefillWorkerBusy(
    JNIEnv* env, jclass cls, jlong d, jintArray tokens, jlongArray hashes, jlong num_tokens,
    jobject options, jdouble threshold) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  tokens_in t;
  kvr_request_options o;
  int busy = 0;
  /* Copied: a preview takes the router's admission lock (see tokens_in). */
  if (read_request_options(env, &s, options, &o) == 0 &&
      prompt_prepare(env, &s, tokens, NULL, 0, 0, hashes, num_tokens, 0, &o, &t) == 0) {
    kvr_error* err = NULL;
    const uint32_t* p;
    if (tokens_begin(env, &t, &p) == 0) {
      kvr_status st = kvr_disagg_prefill_worker_busy(DISAGG(d), p, t.n, &o, threshold, &busy, &err);
      tokens_end(env, &t);
      check(env, st, &err);
    }
  }
  scratch_free(&s);
  return busy ? JNI_TRUE : JNI_FALSE;
}

/* ---- Event batches -------------------------------------------------------------------------- */

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_eventBatchNew(JNIEnv* env, jclass cls) {
  (void)cls;
  kvr_event_batch* batch = NULL;
  kvr_error* err = NULL;
  if (check(env, kvr_event_batch_new(&batch, &err), &err) != 0) return 0;
  return HANDLE(batch);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_eventBatchFree(JNIEnv* env, jclass cls, jlong b) {
  (void)env;
  (void)cls;
  kvr_event_batch_free(BATCH(b));
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_eventBatchAddStored(JNIEnv* env, jclass cls, jlong b,
                                                                   jobject event) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  kvr_stored_event e;
  if (read_stored_event(env, &s, event, &e) == 0) {
    kvr_error* err = NULL;
    check(env, kvr_event_batch_add_stored(BATCH(b), &e, &err), &err);
  }
  scratch_free(&s);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_eventBatchAddRemoved(JNIEnv* env, jclass cls,
                                                                    jlong b, jobject event) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  kvr_removed_event e;
  if (read_removed_event(env, &s, event, &e) == 0) {
    kvr_error* err = NULL;
    check(env, kvr_event_batch_add_removed(BATCH(b), &e, &err), &err);
  }
  scratch_free(&s);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_eventBatchAddCleared(JNIEnv* env, jclass cls,
                                                                    jlong b, jlong worker_id,
                                                                    jint dp_rank, jlong event_id) {
  (void)cls;
  kvr_error* err = NULL;
  check(env,
        kvr_event_batch_add_cleared(BATCH(b), (uint64_t)worker_id, (uint32_t)dp_rank,
                                    (uint64_t)event_id, &err),
        &err);
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_eventBatchSize(JNIEnv* env, jclass cls, jlong b) {
  (void)env;
  (void)cls;
  return (jlong)kvr_event_batch_size(BATCH(b));
}

JNIEXPORT jbyteArray JNICALL Java_io_kvrouter_Native_eventBatchEncode(JNIEnv* env, jclass cls,
                                                                      jlong b) {
  (void)cls;
  kvr_buffer* buffer = NULL;
  kvr_error* err = NULL;
  if (check(env, kvr_event_batch_encode(BATCH(b), &buffer, &err), &err) != 0) return NULL;
  return take_buffer(env, buffer);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_eventBatchClear(JNIEnv* env, jclass cls, jlong b) {
  (void)env;
  (void)cls;
  kvr_event_batch_clear(BATCH(b));
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_eventBatchSetPublishTime(JNIEnv* env, jclass cls,
                                                                        jlong b, jlong unix_ns) {
  (void)cls;
  kvr_error* err = NULL;
  check(env, kvr_event_batch_set_publish_time(BATCH(b), (uint64_t)unix_ns, &err), &err);
}

/* ---- Ingest --------------------------------------------------------------------------------- */

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_ingestNew(JNIEnv* env, jclass cls, jlong r,
                                                          jlongArray options) {
  (void)cls;
  kvr_ingest_options o;
  if (options != NULL && read_ingest_options(env, options, &o) != 0) return 0;
  kvr_ingest* ingest = NULL;
  kvr_error* err = NULL;
  kvr_status st = kvr_ingest_new(ROUTER(r), options != NULL ? &o : NULL, &ingest, &err);
  if (check(env, st, &err) != 0) return 0;
  return HANDLE(ingest);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_ingestStart(JNIEnv* env, jclass cls, jlong i) {
  (void)cls;
  kvr_error* err = NULL;
  check(env, kvr_ingest_start(INGEST(i), &err), &err);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_ingestStop(JNIEnv* env, jclass cls, jlong i) {
  (void)cls;
  kvr_error* err = NULL;
  check(env, kvr_ingest_stop(INGEST(i), &err), &err);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_ingestFree(JNIEnv* env, jclass cls, jlong i) {
  (void)env;
  (void)cls;
  kvr_ingest_free(INGEST(i));
}

/* A source's endpoint as a Java string (growing the buffer as the library asks). */
static jstring source_endpoint(JNIEnv* env, scratch* s, kvr_ingest* ingest, uint64_t source) {
  size_t cap = 256;
  for (int attempt = 0; attempt < 2; ++attempt) {
    char* buf = (char*)scratch_alloc(env, s, cap);
    if (buf == NULL) return NULL;
    size_t len = 0;
    kvr_error* err = NULL;
    kvr_status st = kvr_ingest_source_endpoint(ingest, source, buf, cap, &len, &err);
    if (st == KVR_BUFFER_TOO_SMALL && attempt == 0) {
      kvr_error_free(err);
      cap = len;
      continue;
    }
    if (check(env, st, &err) != 0) return NULL;
    return new_string(env, buf);
  }
  return NULL; /* not reached: the second attempt returns */
}

JNIEXPORT jstring JNICALL Java_io_kvrouter_Native_ingestSourceEndpoint(JNIEnv* env, jclass cls,
                                                                       jlong i, jlong source) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  jstring result = source_endpoint(env, &s, INGEST(i), (uint64_t)source);
  scratch_free(&s);
  return result;
}

JNIEXPORT jstring JNICALL Java_io_kvrouter_Native_ingestListen(JNIEnv* env, jclass cls, jlong i,
                                                               jstring endpoint,
                                                               jlongArray source_out) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  jstring result = NULL;
  const char* ep = NULL;
  if (utf8(env, &s, endpoint, &ep) != 0) goto done;
  if (ep == NULL) {
    throw_iae(env, "kvrouter: null endpoint");
    goto done;
  }
  /* A second kvr_ingest_listen would open a second listener: the buffer is sized generously
   * (a resolved TCP address or the socket path), and if it is short all the same, the
   * endpoint is read with kvr_ingest_source_endpoint. */
  const size_t cap = 2 * strlen(ep) + 4096;
  char* bound = (char*)scratch_alloc(env, &s, cap);
  if (bound == NULL) goto done;
  uint64_t source = 0;
  size_t len = 0;
  kvr_error* err = NULL;
  kvr_status st = kvr_ingest_listen(INGEST(i), ep, &source, bound, cap, &len, &err);
  if (st == KVR_BUFFER_TOO_SMALL) { /* listening all the same: ask for the endpoint */
    kvr_error_free(err);
    err = NULL;
    const jlong id[1] = {(jlong)source};
    if (put_longs(env, source_out, id, 1) == 0) {
      result = source_endpoint(env, &s, INGEST(i), source);
    }
    goto done;
  }
  if (check(env, st, &err) != 0) goto done;
  const jlong v[1] = {(jlong)source};
  if (put_longs(env, source_out, v, 1) != 0) goto done;
  result = new_string(env, bound);
done:
  scratch_free(&s);
  return result;
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_ingestAddEngineWorker(JNIEnv* env, jclass cls,
                                                                      jlong i, jlongArray scalars,
                                                                      jstring endpoint,
                                                                      jstring topic,
                                                                      jstring replay) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  uint64_t source = 0;
  jlong v[ABI_ENGINE_WORKER_LEN];
  kvr_engine_worker w;
  if (INIT(env, kvr_engine_worker_init, &w) != 0 ||
      read_scalars(env, scalars, v, ABI_ENGINE_WORKER_LEN) != 0) {
    goto done;
  }
  abi_decode_engine_worker(v, &w);
  if (utf8(env, &s, endpoint, &w.endpoint) != 0 || utf8(env, &s, topic, &w.topic) != 0 ||
      utf8(env, &s, replay, &w.replay_endpoint) != 0) {
    goto done;
  }
  kvr_error* err = NULL;
  check(env, kvr_ingest_add_engine_worker(INGEST(i), &w, &source, &err), &err);
done:
  scratch_free(&s);
  return (jlong)source;
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_ingestRemoveEngineWorker(JNIEnv* env, jclass cls,
                                                                        jlong i, jlong worker_id,
                                                                        jboolean clear_index) {
  (void)cls;
  kvr_error* err = NULL;
  check(env,
        kvr_ingest_remove_engine_worker(INGEST(i), (uint64_t)worker_id, clear_index ? 1 : 0, &err),
        &err);
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_ingestSubscribeNats(JNIEnv* env, jclass cls,
                                                                    jlong i, jstring url,
                                                                    jstring subject) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  uint64_t source = 0;
  const char* c_url = NULL;
  const char* c_subject = NULL;
  if (utf8(env, &s, url, &c_url) == 0 && utf8(env, &s, subject, &c_subject) == 0) {
    kvr_error* err = NULL;
    check(env, kvr_ingest_subscribe_nats(INGEST(i), c_url, c_subject, &source, &err), &err);
  }
  scratch_free(&s);
  return (jlong)source;
}

/* kvr_ingest_subscribe_jetstream or kvr_ingest_relay_jetstream of a kvr_jetstream_source filled
 * from JetStreamSource's fields: the source id (0 with a Java exception pending on error). */
static jlong with_jetstream(JNIEnv* env, jlong i, jlongArray scalars, jstring url, jstring stream,
                            jstring subject, jstring durable,
                            kvr_status (*call)(kvr_ingest*, const kvr_jetstream_source*, uint64_t*,
                                               kvr_error**)) {
  scratch s;
  scratch_init(&s);
  uint64_t source = 0;
  jlong v[ABI_JETSTREAM_SOURCE_LEN];
  kvr_jetstream_source js;
  if (INIT(env, kvr_jetstream_source_init, &js) == 0 &&
      read_scalars(env, scalars, v, ABI_JETSTREAM_SOURCE_LEN) == 0) {
    abi_decode_jetstream_source(v, &js);
    if (utf8(env, &s, url, &js.url) == 0 && utf8(env, &s, stream, &js.stream) == 0 &&
        utf8(env, &s, subject, &js.subject) == 0 && utf8(env, &s, durable, &js.durable) == 0) {
      kvr_error* err = NULL;
      check(env, call(INGEST(i), &js, &source, &err), &err);
    }
  }
  scratch_free(&s);
  return (jlong)source;
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_ingestSubscribeJetStream(
    JNIEnv* env, jclass cls, jlong i, jlongArray scalars, jstring url, jstring stream,
    jstring subject, jstring durable) {
  (void)cls;
  return with_jetstream(env, i, scalars, url, stream, subject, durable,
                        kvr_ingest_subscribe_jetstream);
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_ingestRelayJetStream(JNIEnv* env, jclass cls,
                                                                     jlong i, jlongArray scalars,
                                                                     jstring url, jstring stream,
                                                                     jstring subject,
                                                                     jstring durable) {
  (void)cls;
  return with_jetstream(env, i, scalars, url, stream, subject, durable, kvr_ingest_relay_jetstream);
}

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_ingestSyncReplicas(JNIEnv* env, jclass cls, jlong i,
                                                                   jstring url, jstring subject,
                                                                   jstring replica_id) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  uint64_t source = 0;
  const char* c_url = NULL;
  const char* c_subject = NULL;
  const char* c_id = NULL;
  if (utf8(env, &s, url, &c_url) == 0 && utf8(env, &s, subject, &c_subject) == 0 &&
      utf8(env, &s, replica_id, &c_id) == 0) {
    kvr_error* err = NULL;
    check(env, kvr_ingest_sync_replicas(INGEST(i), c_url, c_subject, c_id, &source, &err), &err);
  }
  scratch_free(&s);
  return (jlong)source;
}

JNIEXPORT jlongArray JNICALL Java_io_kvrouter_Native_ingestStats(JNIEnv* env, jclass cls, jlong i,
                                                                 jlong source) {
  (void)cls;
  kvr_ingest_stats st;
  if (INIT(env, kvr_ingest_stats_init, &st) != 0) return NULL;
  kvr_error* err = NULL;
  if (check(env, kvr_ingest_get_stats(INGEST(i), (uint64_t)source, &st, &err), &err) != 0) {
    return NULL;
  }
  jlong v[ABI_INGEST_STATS_LEN];
  abi_encode_ingest_stats(&st, v);
  return new_longs(env, v, ABI_INGEST_STATS_LEN);
}

/* ---- Publisher ------------------------------------------------------------------------------ */

JNIEXPORT jlong JNICALL Java_io_kvrouter_Native_publisherConnect(JNIEnv* env, jclass cls,
                                                                 jstring endpoint) {
  (void)cls;
  scratch s;
  scratch_init(&s);
  kvr_publisher* publisher = NULL;
  const char* ep = NULL;
  if (utf8(env, &s, endpoint, &ep) == 0) {
    kvr_error* err = NULL;
    check(env, kvr_publisher_connect(ep, &publisher, &err), &err);
  }
  scratch_free(&s);
  return HANDLE(publisher);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_publisherSend(JNIEnv* env, jclass cls, jlong p,
                                                             jlong b) {
  (void)cls;
  kvr_error* err = NULL;
  check(env, kvr_publisher_send(PUBLISHER(p), BATCH(b), &err), &err);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_publisherSendEncoded(JNIEnv* env, jclass cls,
                                                                    jlong p, jbyteArray data,
                                                                    jint offset, jint length) {
  (void)cls;
  if (check_range(env, data, offset, length) != 0) return;
  scratch s;
  scratch_init(&s);
  const void* bytes = NULL;
  /* Copied, not critical: the send blocks while the socket is full. */
  if (copy_bytes(env, &s, data, offset, length, &bytes) == 0) {
    kvr_error* err = NULL;
    check(env, kvr_publisher_send_encoded(PUBLISHER(p), bytes, (size_t)length, &err), &err);
  }
  scratch_free(&s);
}

JNIEXPORT void JNICALL Java_io_kvrouter_Native_publisherFree(JNIEnv* env, jclass cls, jlong p) {
  (void)env;
  (void)cls;
  kvr_publisher_free(PUBLISHER(p));
}
