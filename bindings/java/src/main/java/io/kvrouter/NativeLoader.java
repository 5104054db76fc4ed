package io.kvrouter;

import java.io.IOException;
import java.io.InputStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.util.ArrayList;
import java.util.List;
import java.util.Locale;

/**
 * Loads the JNI glue, libkvrouter_jni, once per class loader, then checks that the kvrouter library
 * it linked against is the version the glue was compiled for.
 *
 * <p>Where from, in order:
 *
 * <ol>
 *   <li>the file named by the system property {@code kvrouter.jni.library}, if set;
 *   <li>the jar (or class directory): {@code /<os>/<arch>/libkvrouter_jni.so}, copied to a
 *       temporary file that is deleted once loaded (Unix) or on exit;
 *   <li>{@code java.library.path} ({@code System.loadLibrary("kvrouter_jni")}).
 * </ol>
 *
 * <p>The glue needs libkvrouter itself: found by the dynamic linker as usual (system library
 * directories, {@code LD_LIBRARY_PATH}, the glue's run path), or loaded first from the file named
 * by the system property {@code kvrouter.library}.
 */
final class NativeLoader {
  static final String LIBRARY = "kvrouter_jni";

  private static boolean loaded;

  private NativeLoader() {}

  /** "linux", "darwin", "windows", or os.name lower-cased without spaces. */
  static String os() {
    String name = System.getProperty("os.name", "").toLowerCase(Locale.ROOT);
    if (name.startsWith("linux")) return "linux";
    if (name.startsWith("mac") || name.startsWith("darwin")) return "darwin";
    if (name.startsWith("windows")) return "windows";
    return name.replace(" ", "");
  }

  /** "x86_64", "aarch64", or os.arch as is. */
  static String arch() {
    String arch = System.getProperty("os.arch", "").toLowerCase(Locale.ROOT);
    switch (arch) {
      case "amd64":
      case "x86_64":
      case "x64":
        return "x86_64";
      case "aarch64":
      case "arm64":
        return "aarch64";
      default:
        return arch;
    }
  }

  /** The glue's path inside the jar. */
  static String resourcePath() {
    return "/" + os() + "/" + arch() + "/" + System.mapLibraryName(LIBRARY);
  }

  static synchronized void load() {
    if (loaded) return;
    String kvrouter = System.getProperty("kvrouter.library");
    if (kvrouter != null && !kvrouter.isEmpty()) System.load(kvrouter);

    List<String> tried = new ArrayList<>();
    if (!loadGlue(tried)) {
      throw new UnsatisfiedLinkError(
          "cannot load the kvrouter JNI library: " + String.join("; ", tried));
    }
    Native.initIds();
    checkVersion();
    loaded = true;
  }

  private static boolean loadGlue(List<String> tried) {
    String explicit = System.getProperty("kvrouter.jni.library");
    if (explicit != null && !explicit.isEmpty()) {
      System.load(explicit); // an explicit choice: its failure is the answer
      return true;
    }
    String resource = resourcePath();
    try (InputStream in = NativeLoader.class.getResourceAsStream(resource)) {
      if (in == null) {
        tried.add(resource + " is not in the jar");
      } else {
        Path file = Files.createTempFile("libkvrouter_jni-", ".so");
        try {
          Files.copy(in, file, StandardCopyOption.REPLACE_EXISTING);
          System.load(file.toAbsolutePath().toString());
          return true;
        } catch (UnsatisfiedLinkError e) {
          tried.add(resource + ": " + e.getMessage());
        } finally {
          deleteLoaded(file);
        }
      }
    } catch (IOException e) {
      tried.add(resource + ": " + e);
    }
    try {
      System.loadLibrary(LIBRARY);
      return true;
    } catch (UnsatisfiedLinkError e) {
      tried.add(
          "java.library.path ("
              + System.getProperty("java.library.path", "")
              + "): "
              + e.getMessage());
    }
    return false;
  }

  /** A loaded library's file can go at once on Unix (the mapping stays); not on Windows. */
  private static void deleteLoaded(Path file) {
    if (os().equals("windows")) {
      file.toFile().deleteOnExit();
      return;
    }
    try {
      Files.deleteIfExists(file);
    } catch (IOException e) {
      file.toFile().deleteOnExit();
    }
  }

  /**
   * Accepts libkvrouter {@link Abi#VERSION_MAJOR}.{@link Abi#VERSION_MINOR}.x (at 0.x a minor
   * release may change the ABI) at the patch level of the header the glue was built against or
   * newer; the glue must have been built against a header of that major.minor too, since its struct
   * codecs and {@link Abi} are generated from the same one.
   */
  private static void checkVersion() {
    checkVersion(Native.version(), Native.versionString(), Native.headerVersion());
  }

  /** The check itself: throws UnsatisfiedLinkError, saying what was found and what is needed. */
  static void checkVersion(int library, String libraryString, int header) {
    int abi = Abi.VERSION_MAJOR * 10000 + Abi.VERSION_MINOR * 100 + Abi.VERSION_PATCH;
    if (header / 100 != abi / 100) {
      throw new UnsatisfiedLinkError(
          "kvrouter version mismatch: the JNI glue was built against kvrouter.h "
              + KvRouter.formatVersion(header)
              + " but the Java classes were generated from "
              + KvRouter.formatVersion(abi)
              + " (rebuild the binding from one source tree)");
    }
    if (library / 100 != abi / 100 || library < header) {
      throw new UnsatisfiedLinkError(
          "kvrouter version mismatch: the library is "
              + libraryString
              + " ("
              + library
              + "); this Java binding needs libkvrouter "
              + Abi.VERSION_MAJOR
              + "."
              + Abi.VERSION_MINOR
              + ".x, "
              + KvRouter.formatVersion(header)
              + " or newer (the header its glue was built against)");
    }
  }
}
