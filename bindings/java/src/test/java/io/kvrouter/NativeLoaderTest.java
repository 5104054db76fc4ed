package io.kvrouter;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertTrue;
import static org.junit.jupiter.api.Assumptions.assumeTrue;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import org.junit.jupiter.api.Test;

/**
 * The shared libraries the jar carries (the index next to the glue) are the ones the process uses:
 * each is mapped from the directory NativeLoader extracted it to, and no other library of the same
 * name (a system copy: Debian's libnats, libzmq, libuv, Abseil are installed on the build machine)
 * is mapped at all.
 */
class NativeLoaderTest {
  /** The path of each file mapping of this process, " (deleted)" left out. */
  static List<String> mappedFiles() throws IOException {
    List<String> files = new ArrayList<>();
    for (String line : Files.readAllLines(Path.of("/proc/self/maps"))) {
      int slash = line.indexOf('/');
      if (slash < 0) continue;
      String file = line.substring(slash);
      if (file.endsWith(" (deleted)")) file = file.substring(0, file.length() - 10);
      if (!files.contains(file)) files.add(file);
    }
    return files;
  }

  /** "libzmq.so" of "libzmq.so.5": what the file names of every build of that library start with. */
  static String stem(String soname) {
    int so = soname.indexOf(".so");
    return so < 0 ? soname : soname.substring(0, so + 3);
  }

  @Test
  void vendoredLibrariesAreTheOnesMapped() throws IOException {
    KvRouter.load();
    List<String> index = NativeLoader.readIndex(NativeLoader.indexPath());
    assumeTrue(
        !index.isEmpty() && Files.exists(Path.of("/proc/self/maps")),
        "no vendored libraries (a shared or non-vendoring build), or no /proc");
    Path dir = NativeLoader.extractedTo();
    assertNotNull(dir, "the glue was not loaded from the jar");
    assertFalse(Files.exists(dir), dir + " is still there after loading");
    for (String prefix : List.of("libnats.so", "libzmq.so", "libuv.so", "libabsl_")) {
      assertTrue(
          index.stream().anyMatch(n -> n.startsWith(prefix)), prefix + "* is not in the index");
    }
    List<String> mapped = mappedFiles();
    assertTrue(mapped.contains(dir.resolve("libkvrouter_jni.so").toString()), mapped.toString());
    for (String name : index) {
      assertTrue(
          mapped.contains(dir.resolve(name).toString()), name + " is not mapped from " + dir);
      String stem = stem(name);
      for (String file : mapped) {
        String base = Path.of(file).getFileName().toString();
        if (base.startsWith(stem)) {
          assertEquals(dir.resolve(name).toString(), file, "another " + stem + " is mapped");
        }
      }
    }
  }

  @Test
  void theIndexNamesPlainFiles() throws IOException {
    for (String name : NativeLoader.readIndex(NativeLoader.indexPath())) {
      assertFalse(name.contains("/"), name);
      assertNotNull(NativeLoader.class.getResource(NativeLoader.resourceDir() + name), name);
    }
    assertEquals("/linux/x86_64/libkvrouter_jni.libs", NativeLoader.indexPath());
  }
}
