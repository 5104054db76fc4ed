package io.kvrouter;

import static java.lang.foreign.ValueLayout.ADDRESS;
import static java.lang.foreign.ValueLayout.JAVA_BYTE;
import static java.lang.foreign.ValueLayout.JAVA_DOUBLE;
import static java.lang.foreign.ValueLayout.JAVA_INT;
import static java.lang.foreign.ValueLayout.JAVA_LONG;

import java.lang.foreign.Arena;
import java.lang.foreign.FunctionDescriptor;
import java.lang.foreign.Linker;
import java.lang.foreign.MemorySegment;
import java.lang.invoke.MethodHandle;
import java.lang.ref.Reference;
import java.nio.IntBuffer;
import java.util.Collections;

/**
 * The hot calls of {@link Router} for JDK 22 and newer, through java.lang.foreign downcalls to the
 * C functions instead of JNI: this class replaces the base {@code HotPath} (JNI) in the
 * multi-release jar (META-INF/versions/22). Same methods, same results, same exceptions.
 *
 * <ul>
 *   <li>The C functions are those of the glue's own libkvrouter (the JNI calls' copy), whose
 *       addresses, struct sizes and field offsets the glue hands over once ({@link
 *       Native#ffmTable()}); the glue exports no C symbol for a lookup to find.
 *   <li>Every call is an ordinary downcall, an {@code int[]} prompt copied to native memory (a
 *       direct IntBuffer is read in place, whatever the call), and so are the hashes of a prompt
 *       given hashed (KVR_REQUEST_PREHASHED: no tokens, the hashes in the options). None can be
 *       a critical downcall ({@code Linker.Option.critical}), which stays in the Java thread
 *       state, so that every safepoint waits for it to return: previews too take the router's
 *       admission lock, which a thread booking a request holds while it calls the replica
 *       publisher, in Java, where it stops at a safepoint; a preview waiting for that lock in a
 *       critical downcall would stop the whole JVM. (An admitted call may also wait in the
 *       admission queue.)
 *   <li>The options, the result, the error slot and the strings (ids, LoRA name, namespace,
 *       UTF-8 with a NUL) live in a per-thread native buffer reused from call to call: no
 *       allocation but the result object. A call made on the same thread while one is in
 *       progress (from a replica publisher) gets a buffer of its own.
 *   <li>A failure becomes its exception in the glue ({@link Native#throwStatus}), so it is the
 *       JNI path's to the message.
 *   <li>Everything else goes through JNI ({@link JniHotPath}): options beyond the simple ones,
 *       routing hints, and every call when this module may not use restricted methods
 *       (native access denied to it: JDK 22 and 23 with {@code --enable-native-access} naming
 *       other modules only, JDK 24+ with {@code --illegal-native-access=deny}) or
 *       {@code -Dkvrouter.ffm=false} is set.
 * </ul>
 */
final class HotPath {
  private HotPath() {}

  // The slots of Native.ffmTable() (its order in kvrouter_jni.c).
  private static final int T_FIND_BEST_MATCH = 0;
  private static final int T_PREVIEW_ROUTE = 1;
  private static final int T_FREE_REQUEST = 2;
  private static final int T_MARK_PREFILL_COMPLETED = 3;
  private static final int T_REQUEST_OPTIONS_INIT = 4;
  private static final int T_ROUTE_RESULT_INIT = 5;
  private static final int T_ROUTE_SIGNALS_INIT = 6;
  private static final int T_OPTIONS_SIZE = 7; // then flags, request_id, lora_name, namespace
  private static final int T_RESULT_SIZE = 12; // then dp_rank ... queued, as RouteResult
  private static final int T_SIGNALS_SIZE = 23; // then dp_rank ... queued, as RouteSignals
  private static final int T_OPTIONS_LOCAL_HASHES = 36; // then num_local_hashes
  private static final int T_LEN = 38;

  private static final boolean ENABLED;
  private static final long[] T;

  static {
    Native.init();
    T = Native.ffmTable();
    if (T.length != T_LEN) {
      throw new IllegalStateException("libkvrouter_jni: ffmTable has " + T.length + " slots");
    }
    ENABLED =
        !"false".equals(System.getProperty("kvrouter.ffm"))
            && HotPath.class.getModule().isNativeAccessEnabled();
  }

  // The structs' sizes and field offsets, as the glue was compiled.
  private static final long OPTIONS_SIZE = T[T_OPTIONS_SIZE];
  private static final long O_FLAGS = T[T_OPTIONS_SIZE + 1];
  private static final long O_REQUEST_ID = T[T_OPTIONS_SIZE + 2];
  private static final long O_LORA_NAME = T[T_OPTIONS_SIZE + 3];
  private static final long O_CACHE_NAMESPACE = T[T_OPTIONS_SIZE + 4];
  private static final long O_LOCAL_HASHES = T[T_OPTIONS_LOCAL_HASHES];
  private static final long O_NUM_LOCAL_HASHES = T[T_OPTIONS_LOCAL_HASHES + 1];
  private static final long RESULT_SIZE = T[T_RESULT_SIZE];
  private static final long R_DP_RANK = T[T_RESULT_SIZE + 1];
  private static final long R_WORKER_ID = T[T_RESULT_SIZE + 2];
  private static final long R_PROMPT_BLOCKS = T[T_RESULT_SIZE + 3];
  private static final long R_DEVICE_OVERLAP_BLOCKS = T[T_RESULT_SIZE + 4];
  private static final long R_EFFECTIVE_OVERLAP_BLOCKS = T[T_RESULT_SIZE + 5];
  private static final long R_CACHED_TOKENS = T[T_RESULT_SIZE + 6];
  private static final long R_PROMPT_TOKENS = T[T_RESULT_SIZE + 7];
  private static final long R_COST = T[T_RESULT_SIZE + 8];
  private static final long R_BOOKED = T[T_RESULT_SIZE + 9];
  private static final long R_QUEUED = T[T_RESULT_SIZE + 10];
  private static final long SIGNALS_SIZE = T[T_SIGNALS_SIZE];
  private static final long S_DP_RANK = T[T_SIGNALS_SIZE + 1];
  private static final long S_WORKER_ID = T[T_SIGNALS_SIZE + 2];
  private static final long S_OVERLAP_BLOCKS = T[T_SIGNALS_SIZE + 3];
  private static final long S_PROMPT_BLOCKS = T[T_SIGNALS_SIZE + 4];
  private static final long S_CACHED_TOKENS = T[T_SIGNALS_SIZE + 5];
  private static final long S_POTENTIAL_DECODE_BLOCKS = T[T_SIGNALS_SIZE + 6];
  private static final long S_TOTAL_KV_BLOCKS = T[T_SIGNALS_SIZE + 7];
  private static final long S_COST = T[T_SIGNALS_SIZE + 8];
  private static final long S_PROMPT_TOKENS = T[T_SIGNALS_SIZE + 9];
  private static final long S_BOOKED = T[T_SIGNALS_SIZE + 10];
  private static final long S_MOVED = T[T_SIGNALS_SIZE + 11];
  private static final long S_QUEUED = T[T_SIGNALS_SIZE + 12];

  // Where each part sits in a thread's buffer: the options; the result and the signals, each
  // after a copy of its _init defaults (copied over it before every call, as the JNI calls
  // initialise theirs); the error slot; the candidate count.
  private static final long B_OPTIONS = 0;
  private static final long B_RESULT_DEFAULTS = align(B_OPTIONS + OPTIONS_SIZE);
  private static final long B_RESULT = align(B_RESULT_DEFAULTS + RESULT_SIZE);
  private static final long B_SIGNALS_DEFAULTS = align(B_RESULT + RESULT_SIZE);
  private static final long B_SIGNALS = align(B_SIGNALS_DEFAULTS + SIGNALS_SIZE);
  private static final long B_ERROR = align(B_SIGNALS + SIGNALS_SIZE);
  private static final long B_TOTAL = B_ERROR + 8; // num_candidates (size_t)
  private static final long B_SIZE = B_TOTAL + 8;

  private static long align(long n) {
    return (n + 7) & ~7L;
  }

  // Pointers this class computes cross as longs (a pointer and a 64-bit integer are passed
  // alike on every 64-bit ABI the linker supports); a copied prompt crosses as a segment.
  private static final FunctionDescriptor FIND_BEST_MATCH_D =
      FunctionDescriptor.of(
          JAVA_INT, // kvr_status
          JAVA_LONG, // router
          ADDRESS, // tokens
          JAVA_LONG, // num_tokens
          JAVA_LONG, // opts
          JAVA_LONG, // out
          JAVA_LONG, // candidates
          JAVA_LONG, // cap
          JAVA_LONG, // num_candidates
          JAVA_LONG); // err
  // The same, the prompt as an address (a direct buffer's, kept alive by the caller).
  private static final FunctionDescriptor FIND_BEST_MATCH_AT_D =
      FunctionDescriptor.of(
          JAVA_INT,
          JAVA_LONG,
          JAVA_LONG,
          JAVA_LONG,
          JAVA_LONG,
          JAVA_LONG,
          JAVA_LONG,
          JAVA_LONG,
          JAVA_LONG,
          JAVA_LONG);
  private static final FunctionDescriptor PREVIEW_ROUTE_D =
      FunctionDescriptor.of(
          JAVA_INT, JAVA_LONG, ADDRESS, JAVA_LONG, JAVA_LONG, JAVA_LONG, JAVA_LONG, JAVA_LONG);
  private static final FunctionDescriptor ID_CALL_D =
      FunctionDescriptor.of(JAVA_INT, JAVA_LONG, JAVA_LONG, JAVA_LONG);
  private static final FunctionDescriptor INIT_D =
      FunctionDescriptor.of(JAVA_INT, JAVA_LONG, JAVA_LONG);

  private static final MethodHandle FIND_BEST_MATCH;
  private static final MethodHandle FIND_BEST_MATCH_AT;
  private static final MethodHandle PREVIEW_ROUTE;
  private static final MethodHandle FREE_REQUEST;
  private static final MethodHandle MARK_PREFILL_COMPLETED;
  private static final MethodHandle REQUEST_OPTIONS_INIT;
  private static final MethodHandle ROUTE_RESULT_INIT;
  private static final MethodHandle ROUTE_SIGNALS_INIT;

  static {
    if (ENABLED) {
      Linker linker = Linker.nativeLinker();
      FIND_BEST_MATCH = downcall(linker, T_FIND_BEST_MATCH, FIND_BEST_MATCH_D);
      FIND_BEST_MATCH_AT = downcall(linker, T_FIND_BEST_MATCH, FIND_BEST_MATCH_AT_D);
      PREVIEW_ROUTE = downcall(linker, T_PREVIEW_ROUTE, PREVIEW_ROUTE_D);
      FREE_REQUEST = downcall(linker, T_FREE_REQUEST, ID_CALL_D);
      MARK_PREFILL_COMPLETED = downcall(linker, T_MARK_PREFILL_COMPLETED, ID_CALL_D);
      REQUEST_OPTIONS_INIT = downcall(linker, T_REQUEST_OPTIONS_INIT, INIT_D);
      ROUTE_RESULT_INIT = downcall(linker, T_ROUTE_RESULT_INIT, INIT_D);
      ROUTE_SIGNALS_INIT = downcall(linker, T_ROUTE_SIGNALS_INIT, INIT_D);
    } else {
      FIND_BEST_MATCH = null;
      FIND_BEST_MATCH_AT = null;
      PREVIEW_ROUTE = null;
      FREE_REQUEST = null;
      MARK_PREFILL_COMPLETED = null;
      REQUEST_OPTIONS_INIT = null;
      ROUTE_RESULT_INIT = null;
      ROUTE_SIGNALS_INIT = null;
    }
  }

  private static MethodHandle downcall(
      Linker linker, int slot, FunctionDescriptor d, Linker.Option... options) {
    return linker.downcallHandle(MemorySegment.ofAddress(T[slot]), d, options);
  }

  private static final ThreadLocal<Buffer> BUFFERS = ThreadLocal.withInitial(Buffer::new);

  /** Which implementation serves the hot calls: {@code "ffm"}, or {@code "jni"} if disabled. */
  static String kind() {
    return ENABLED ? "ffm" : "jni";
  }

  static RouteResult findBestMatch(
      long router, int[] tokens, IntBuffer direct, int offset, int length, RequestOptions options) {
    if (!ENABLED) return JniHotPath.findBestMatch(router, tokens, direct, offset, length, options);
    Buffer b = Buffer.enter();
    try {
      long opts = 0;
      if (options != null) {
        b.options(
            options.simpleFlags(), options.requestId, options.loraName, options.cacheNamespace);
        opts = b.address + B_OPTIONS;
      }
      MemorySegment m = b.memory;
      MemorySegment.copy(m, B_RESULT_DEFAULTS, m, B_RESULT, RESULT_SIZE);
      long out = b.address + B_RESULT;
      long err = b.address + B_ERROR;
      // The total number of candidates is asked for whatever the options (as the JNI calls).
      m.set(JAVA_LONG, B_TOTAL, 0L);
      final long total = b.address + B_TOTAL;
      int status;
      if (direct != null) {
        // In place: the address of its position (the segment object does not escape, so it
        // costs no allocation), the buffer kept reachable until the call returned.
        long prompt = MemorySegment.ofBuffer(direct).address();
        status =
            (int)
                FIND_BEST_MATCH_AT.invokeExact(
                    router, prompt, (long) length, opts, out, 0L, 0L, total, err);
        Reference.reachabilityFence(direct);
      } else {
        // Copied, for previews too (see the class comment: no critical downcall).
        MemorySegment prompt = b.tokens(tokens);
        status =
            (int)
                FIND_BEST_MATCH.invokeExact(
                    router, prompt, (long) tokens.length, opts, out, 0L, 0L, total, err);
      }
      if (status != 0) throw b.failure(status);
      return routeResult(m);
    } catch (RuntimeException | Error e) {
      throw e;
    } catch (Throwable t) {
      throw new AssertionError(t);
    } finally {
      b.exit();
    }
  }

  /**
   * {@link #findBestMatch} for a prompt given hashed: no tokens, the hashes copied to the thread's
   * native buffer and named in the options with KVR_REQUEST_PREHASHED (so the options struct is
   * passed whatever {@code options}).
   */
  static RouteResult findBestMatchHashed(
      long router, long[] hashes, long numTokens, RequestOptions options) {
    if (!ENABLED) return JniHotPath.findBestMatchHashed(router, hashes, numTokens, options);
    Buffer b = Buffer.enter();
    try {
      if (options == null) {
        b.options(0, null, null, null);
      } else {
        b.options(
            options.simpleFlags(), options.requestId, options.loraName, options.cacheNamespace);
      }
      b.hashes(hashes);
      MemorySegment m = b.memory;
      MemorySegment.copy(m, B_RESULT_DEFAULTS, m, B_RESULT, RESULT_SIZE);
      m.set(JAVA_LONG, B_TOTAL, 0L);
      int status =
          (int)
              FIND_BEST_MATCH_AT.invokeExact(
                  router,
                  0L,
                  numTokens,
                  b.address + B_OPTIONS,
                  b.address + B_RESULT,
                  0L,
                  0L,
                  b.address + B_TOTAL,
                  b.address + B_ERROR);
      if (status != 0) throw b.failure(status);
      return routeResult(m);
    } catch (RuntimeException | Error e) {
      throw e;
    } catch (Throwable t) {
      throw new AssertionError(t);
    } finally {
      b.exit();
    }
  }

  private static RouteResult routeResult(MemorySegment m) {
    return new RouteResult(
        m.get(JAVA_LONG, B_RESULT + R_WORKER_ID),
        m.get(JAVA_INT, B_RESULT + R_DP_RANK),
        m.get(JAVA_INT, B_RESULT + R_PROMPT_BLOCKS),
        m.get(JAVA_INT, B_RESULT + R_DEVICE_OVERLAP_BLOCKS),
        m.get(JAVA_DOUBLE, B_RESULT + R_EFFECTIVE_OVERLAP_BLOCKS),
        m.get(JAVA_LONG, B_RESULT + R_CACHED_TOKENS),
        m.get(JAVA_LONG, B_RESULT + R_PROMPT_TOKENS),
        m.get(JAVA_DOUBLE, B_RESULT + R_COST),
        m.get(JAVA_INT, B_RESULT + R_BOOKED) != 0,
        m.get(JAVA_INT, B_RESULT + R_QUEUED) != 0,
        Collections.emptyList(),
        m.get(JAVA_LONG, B_TOTAL));
  }

  static RouteSignals previewRoute(
      long router, int[] tokens, RequestOptions options, RoutingHints hints) {
    if (!ENABLED || hints != null || (options != null && options.simpleFlags() < 0)) {
      return JniHotPath.previewRoute(router, tokens, options, hints);
    }
    Buffer b = Buffer.enter();
    try {
      long opts = 0;
      if (options != null) {
        b.options(
            options.simpleFlags(), options.requestId, options.loraName, options.cacheNamespace);
        opts = b.address + B_OPTIONS;
      }
      MemorySegment m = b.memory;
      MemorySegment.copy(m, B_SIGNALS_DEFAULTS, m, B_SIGNALS, SIGNALS_SIZE);
      // Never books (KVR_REQUEST_ADMIT is ignored) but takes the router's admission lock: an
      // ordinary downcall, the prompt copied (see the class comment).
      int status =
          (int)
              PREVIEW_ROUTE.invokeExact(
                  router,
                  b.tokens(tokens),
                  (long) tokens.length,
                  opts,
                  0L,
                  b.address + B_SIGNALS,
                  b.address + B_ERROR);
      if (status != 0) throw b.failure(status);
      return routeSignals(m);
    } catch (RuntimeException | Error e) {
      throw e;
    } catch (Throwable t) {
      throw new AssertionError(t);
    } finally {
      b.exit();
    }
  }

  /** {@link #previewRoute} for a prompt given hashed (as {@link #findBestMatchHashed}). */
  static RouteSignals previewRouteHashed(
      long router, long[] hashes, long numTokens, RequestOptions options, RoutingHints hints) {
    if (!ENABLED || hints != null || (options != null && options.simpleFlags() < 0)) {
      return JniHotPath.previewRouteHashed(router, hashes, numTokens, options, hints);
    }
    Buffer b = Buffer.enter();
    try {
      if (options == null) {
        b.options(0, null, null, null);
      } else {
        b.options(
            options.simpleFlags(), options.requestId, options.loraName, options.cacheNamespace);
      }
      b.hashes(hashes);
      MemorySegment m = b.memory;
      MemorySegment.copy(m, B_SIGNALS_DEFAULTS, m, B_SIGNALS, SIGNALS_SIZE);
      int status =
          (int)
              PREVIEW_ROUTE.invokeExact(
                  router,
                  MemorySegment.NULL,
                  numTokens,
                  b.address + B_OPTIONS,
                  0L,
                  b.address + B_SIGNALS,
                  b.address + B_ERROR);
      if (status != 0) throw b.failure(status);
      return routeSignals(m);
    } catch (RuntimeException | Error e) {
      throw e;
    } catch (Throwable t) {
      throw new AssertionError(t);
    } finally {
      b.exit();
    }
  }

  private static RouteSignals routeSignals(MemorySegment m) {
    return new RouteSignals(
        m.get(JAVA_LONG, B_SIGNALS + S_WORKER_ID),
        m.get(JAVA_INT, B_SIGNALS + S_DP_RANK),
        m.get(JAVA_INT, B_SIGNALS + S_OVERLAP_BLOCKS),
        m.get(JAVA_INT, B_SIGNALS + S_PROMPT_BLOCKS),
        m.get(JAVA_LONG, B_SIGNALS + S_CACHED_TOKENS),
        m.get(JAVA_LONG, B_SIGNALS + S_POTENTIAL_DECODE_BLOCKS),
        m.get(JAVA_LONG, B_SIGNALS + S_TOTAL_KV_BLOCKS),
        m.get(JAVA_DOUBLE, B_SIGNALS + S_COST),
        m.get(JAVA_LONG, B_SIGNALS + S_PROMPT_TOKENS),
        m.get(JAVA_INT, B_SIGNALS + S_BOOKED) != 0,
        m.get(JAVA_INT, B_SIGNALS + S_MOVED) != 0,
        m.get(JAVA_INT, B_SIGNALS + S_QUEUED) != 0);
  }

  // markPrefillCompleted and freeRequest repeat each other on purpose: a method handle passed
  // as an argument is not a constant, so its invokeExact would not be inlined.
  static void markPrefillCompleted(long router, String requestId) {
    if (!ENABLED) {
      JniHotPath.markPrefillCompleted(router, requestId);
      return;
    }
    Buffer b = Buffer.enter();
    try {
      long id = b.string(requestId);
      int status = (int) MARK_PREFILL_COMPLETED.invokeExact(router, id, b.address + B_ERROR);
      if (status != 0) throw b.failure(status);
    } catch (RuntimeException | Error e) {
      throw e;
    } catch (Throwable t) {
      throw new AssertionError(t);
    } finally {
      b.exit();
    }
  }

  static void freeRequest(long router, String requestId) {
    if (!ENABLED) {
      JniHotPath.freeRequest(router, requestId);
      return;
    }
    Buffer b = Buffer.enter();
    try {
      long id = b.string(requestId);
      int status = (int) FREE_REQUEST.invokeExact(router, id, b.address + B_ERROR);
      if (status != 0) throw b.failure(status);
    } catch (RuntimeException | Error e) {
      throw e;
    } catch (Throwable t) {
      throw new AssertionError(t);
    } finally {
      b.exit();
    }
  }

  /**
   * A thread's native memory for its calls: the structs and the error slot ({@code memory}), the
   * strings of a call, and a copy of a call's {@code int[]} prompt or of its hashes. Freed with
   * its arena when the thread (and so the buffer) is gone.
   */
  private static final class Buffer {
    final MemorySegment memory;
    final long address;
    private MemorySegment strings;
    private long stringsAddress;
    private MemorySegment prompt;
    private boolean busy;

    Buffer() {
      memory = Arena.ofAuto().allocate(B_SIZE, 8);
      address = memory.address();
      try {
        check((int) REQUEST_OPTIONS_INIT.invokeExact(address + B_OPTIONS, OPTIONS_SIZE));
        check((int) ROUTE_RESULT_INIT.invokeExact(address + B_RESULT_DEFAULTS, RESULT_SIZE));
        check((int) ROUTE_SIGNALS_INIT.invokeExact(address + B_SIGNALS_DEFAULTS, SIGNALS_SIZE));
      } catch (RuntimeException | Error e) {
        throw e;
      } catch (Throwable t) {
        throw new AssertionError(t);
      }
      strings = Arena.ofAuto().allocate(256);
      stringsAddress = strings.address();
      prompt = Arena.ofAuto().allocate(4L * 1024, 8);
    }

    private static void check(int status) {
      if (status != 0) Native.throwStatus(status, 0);
    }

    /** This thread's buffer, or a new one if a call of this thread is using it. */
    static Buffer enter() {
      Buffer b = BUFFERS.get();
      if (b.busy) b = new Buffer();
      b.busy = true;
      return b;
    }

    void exit() {
      busy = false;
    }

    /**
     * Sets the options' flags and strings, and no hashes (the rest stays the library's defaults).
     */
    void options(int flags, String requestId, String loraName, String cacheNamespace) {
      reserve(utf8Bound(requestId) + utf8Bound(loraName) + utf8Bound(cacheNamespace));
      long at = 0;
      long id = 0;
      long lora = 0;
      long ns = 0;
      if (requestId != null) {
        id = stringsAddress + at;
        at = putUtf8(requestId, at);
      }
      if (loraName != null) {
        lora = stringsAddress + at;
        at = putUtf8(loraName, at);
      }
      if (cacheNamespace != null) {
        ns = stringsAddress + at;
        putUtf8(cacheNamespace, at);
      }
      MemorySegment m = memory;
      m.set(JAVA_INT, B_OPTIONS + O_FLAGS, flags);
      m.set(JAVA_LONG, B_OPTIONS + O_REQUEST_ID, id);
      m.set(JAVA_LONG, B_OPTIONS + O_LORA_NAME, lora);
      m.set(JAVA_LONG, B_OPTIONS + O_CACHE_NAMESPACE, ns);
      m.set(JAVA_LONG, B_OPTIONS + O_LOCAL_HASHES, 0L);
      m.set(JAVA_LONG, B_OPTIONS + O_NUM_LOCAL_HASHES, 0L);
    }

    /**
     * After {@link #options}: the prompt is given hashed, {@code hashes} copied to the prompt's
     * native memory (an ordinary downcall, as for tokens) and named in the options with
     * KVR_REQUEST_PREHASHED.
     */
    void hashes(long[] hashes) {
      long bytes = 8L * hashes.length;
      if (bytes > prompt.byteSize()) {
        prompt = Arena.ofAuto().allocate(Math.max(bytes, 2 * prompt.byteSize()), 8);
      }
      MemorySegment.copy(hashes, 0, prompt, JAVA_LONG, 0, hashes.length);
      MemorySegment m = memory;
      int flags = m.get(JAVA_INT, B_OPTIONS + O_FLAGS);
      m.set(JAVA_INT, B_OPTIONS + O_FLAGS, flags | Abi.REQUEST_PREHASHED);
      m.set(JAVA_LONG, B_OPTIONS + O_LOCAL_HASHES, prompt.address());
      m.set(JAVA_LONG, B_OPTIONS + O_NUM_LOCAL_HASHES, (long) hashes.length);
    }

    /** The address of {@code s} in UTF-8 with a NUL, or 0 for null. */
    long string(String s) {
      if (s == null) return 0;
      reserve(utf8Bound(s));
      putUtf8(s, 0);
      return stringsAddress;
    }

    private static long utf8Bound(String s) {
      return s == null ? 0 : 3L * s.length() + 1;
    }

    private void reserve(long bytes) {
      if (bytes > strings.byteSize()) {
        strings = Arena.ofAuto().allocate(Math.max(bytes, 2 * strings.byteSize()));
        stringsAddress = strings.address();
      }
    }

    /**
     * Writes {@code s} as UTF-8 and a NUL at {@code at}; returns the offset past the NUL. Refuses
     * what the glue's conversion refuses, with its messages.
     */
    private long putUtf8(String s, long at) {
      MemorySegment m = strings;
      int n = s.length();
      for (int i = 0; i < n; ++i) {
        int c = s.charAt(i);
        if (c != 0 && c < 0x80) {
          m.set(JAVA_BYTE, at++, (byte) c);
        } else if (c == 0) {
          throw new IllegalArgumentException("kvrouter: strings may not contain NUL characters");
        } else if (c < 0x800) {
          m.set(JAVA_BYTE, at++, (byte) (0xC0 | (c >> 6)));
          m.set(JAVA_BYTE, at++, (byte) (0x80 | (c & 0x3F)));
        } else if (c < 0xD800 || c > 0xDFFF) {
          m.set(JAVA_BYTE, at++, (byte) (0xE0 | (c >> 12)));
          m.set(JAVA_BYTE, at++, (byte) (0x80 | ((c >> 6) & 0x3F)));
          m.set(JAVA_BYTE, at++, (byte) (0x80 | (c & 0x3F)));
        } else {
          if (c > 0xDBFF || i + 1 >= n || !Character.isLowSurrogate(s.charAt(i + 1))) {
            throw new IllegalArgumentException("kvrouter: string with an unpaired surrogate");
          }
          int p = Character.toCodePoint((char) c, s.charAt(++i));
          m.set(JAVA_BYTE, at++, (byte) (0xF0 | (p >> 18)));
          m.set(JAVA_BYTE, at++, (byte) (0x80 | ((p >> 12) & 0x3F)));
          m.set(JAVA_BYTE, at++, (byte) (0x80 | ((p >> 6) & 0x3F)));
          m.set(JAVA_BYTE, at++, (byte) (0x80 | (p & 0x3F)));
        }
      }
      m.set(JAVA_BYTE, at++, (byte) 0);
      return at;
    }

    /** A copy of {@code tokens} in native memory (no call is critical: see the class comment). */
    MemorySegment tokens(int[] tokens) {
      long bytes = 4L * tokens.length;
      if (bytes > prompt.byteSize()) {
        prompt = Arena.ofAuto().allocate(Math.max(bytes, 2 * prompt.byteSize()), 8);
      }
      MemorySegment.copy(tokens, 0, prompt, JAVA_INT, 0, tokens.length);
      return prompt;
    }

    /** The exception for a failed call: thrown by the glue, as the JNI calls throw it. */
    RuntimeException failure(int status) {
      long err = memory.get(JAVA_LONG, B_ERROR);
      memory.set(JAVA_LONG, B_ERROR, 0L);
      Native.throwStatus(status, err);
      return new IllegalStateException("kvrouter: status " + status + " threw nothing");
    }
  }
}
