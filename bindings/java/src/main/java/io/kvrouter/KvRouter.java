package io.kvrouter;

/**
 * The library as a whole: versions, status names, storage tiers. Loading any class of this package
 * loads the native library; {@link #load()} does it explicitly (to fail early).
 */
public final class KvRouter {
  private KvRouter() {}

  /**
   * Loads libkvrouter_jni and checks the kvrouter library's version.
   *
   * @throws UnsatisfiedLinkError if a library is missing or the versions do not match
   */
  public static void load() {
    Native.init();
  }

  /** The library's version number: major × 10000 + minor × 100 + patch. */
  public static int version() {
    return Native.version();
  }

  /** The library's version, "MAJOR.MINOR.PATCH". */
  public static String versionString() {
    return Native.versionString();
  }

  /** The version of kvrouter.h the binding was compiled against, as {@link #version()}. */
  public static int headerVersion() {
    return Native.headerVersion();
  }

  /** The C name of a status code ("KVR_NOT_FOUND"; "KVR_UNKNOWN" for an unknown code). */
  public static String statusName(int code) {
    return Native.statusStr(code);
  }

  /** The tier of an engine's "medium" (GPU, CPU_PINNED, DISK, ...); null or unknown: device. */
  public static Tier tierFromMedium(String medium) {
    return Tier.of(Native.tierFromMedium(medium));
  }

  static String formatVersion(int number) {
    return (number / 10000) + "." + (number / 100 % 100) + "." + (number % 100);
  }
}
