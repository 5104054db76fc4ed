package io.kvrouter;

import java.io.IOException;
import java.io.InputStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
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
 *   <li>the file named by the system property {@code kvrouter.jni.library}, if set (its shared
 *       libraries come from the system);
 *   <li>the jar (or class directory): {@code /<os>/<arch>/libkvrouter_jni.so}. If the index {@code
 *       /<os>/<arch>/libkvrouter_jni.libs} is there too, it lists the shared libraries the glue
 *       needs (all but glibc's and the C++ runtime), dependencies first: they and the glue are
 *       copied into one new private temporary directory and loaded from there in that order, then
 *       the glue. The dynamic linker satisfies each {@code NEEDED} entry with the library already
 *       loaded under that soname, so the copies are used with no run path and no {@code
 *       LD_LIBRARY_PATH}, whatever the system has. The directory is deleted once they are loaded
 *       (Unix; on exit elsewhere). The system property {@code kvrouter.jni.vendored=false} loads
 *       the glue alone, its libraries then coming from the system; {@code kvrouter.jni.tmpdir}
 *       names the directory the temporary one is made in (default {@code java.io.tmpdir}: one
 *       that allows mapping executable code);
 *   <li>{@code java.library.path} ({@code System.loadLibrary("kvrouter_jni")}).
 * </ol>
 *
 * <p>A glue linked with libkvrouter.so (a development build) needs that library: found by the
 * dynamic linker as usual (system library directories, {@code LD_LIBRARY_PATH}, the glue's run
 * path), or loaded first from the file named by the system property {@code kvrouter.library}.
 */
final class NativeLoader {
  static final String LIBRARY = "kvrouter_jni";

  private static boolean loaded;

  /** The directory the glue and its libraries were extracted to and loaded from, or null. */
  private static Path extractedTo;

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

  /** The glue's directory inside the jar. */
  static String resourceDir() {
    return "/" + os() + "/" + arch() + "/";
  }

  /** The glue's path inside the jar. */
  static String resourcePath() {
    return resourceDir() + System.mapLibraryName(LIBRARY);
  }

  /** The index of the shared libraries the jar carries for the glue, inside the jar. */
  static String indexPath() {
    return resourceDir() + System.mapLibraryName(LIBRARY).replaceFirst("\\.[^.]*$", "") + ".libs";
  }

  /** Where the jar's native libraries were loaded from (deleted by now on Unix), or null. */
  static synchronized Path extractedTo() {
    return extractedTo;
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
    if (loadFromJar(tried)) return true;
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

  /** The glue and the libraries of its index, from the jar; false (and why in tried) if not. */
  private static boolean loadFromJar(List<String> tried) {
    String resource = resourcePath();
    if (NativeLoader.class.getResource(resource) == null) {
      tried.add(resource + " is not in the jar");
      return false;
    }
    List<String> libraries;
    try {
      libraries =
          "false".equalsIgnoreCase(System.getProperty("kvrouter.jni.vendored"))
              ? List.of()
              : readIndex(indexPath());
    } catch (IOException e) {
      tried.add(indexPath() + ": " + e);
      return false;
    }
    String tmp = System.getProperty("kvrouter.jni.tmpdir");
    Path dir = null;
    List<Path> files = new ArrayList<>();
    String current = resource;
    try {
      dir =
          tmp != null && !tmp.isEmpty()
              ? Files.createTempDirectory(Path.of(tmp), "kvrouter-native-")
              : Files.createTempDirectory("kvrouter-native-"); // owner-only on POSIX
      dir = dir.toRealPath(); // as /proc/self/maps will show it
      List<String> names = new ArrayList<>(libraries);
      names.add(System.mapLibraryName(LIBRARY));
      for (String name : names) {
        current = resourceDir() + name;
        Path file = dir.resolve(name);
        try (InputStream in = NativeLoader.class.getResourceAsStream(current)) {
          if (in == null) throw new IOException("not in the jar (listed in " + indexPath() + ")");
          files.add(file);
          Files.copy(in, file);
        }
      }
      for (Path file : files) {
        current = resourceDir() + file.getFileName();
        System.load(file.toAbsolutePath().toString());
      }
      extractedTo = dir;
      return true;
    } catch (IOException e) {
      tried.add(current + ": " + e);
    } catch (UnsatisfiedLinkError e) {
      tried.add(current + ": " + e.getMessage());
    } finally {
      // deleteOnExit (Windows) deletes in reverse order: the directory is registered first.
      boolean windows = os().equals("windows");
      if (dir != null && windows) deleteLoaded(dir);
      for (Path file : files) deleteLoaded(file);
      if (dir != null && !windows) deleteLoaded(dir);
    }
    return false;
  }

  /** The index's file names (lines but blank ones and # comments), or none if it is absent. */
  static List<String> readIndex(String index) throws IOException {
    List<String> names = new ArrayList<>();
    try (InputStream in = NativeLoader.class.getResourceAsStream(index)) {
      if (in == null) return names;
      for (String line : new String(in.readAllBytes(), StandardCharsets.UTF_8).split("\n")) {
        String name = line.strip();
        if (name.isEmpty() || name.startsWith("#")) continue;
        if (name.contains("/") || name.startsWith(".")) throw new IOException("bad entry " + name);
        names.add(name);
      }
    }
    return names;
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
