package io.kvrouter;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * The glue under the JVM's JNI checks: a child JVM with {@code -Xcheck:jni} runs the other tests'
 * methods ({@link JniExercise}); any JNI warning or error it prints fails this test. (The whole
 * suite also runs with -Xcheck:jni through surefire's argLine, where a fatal misuse aborts the
 * fork, but warnings only reach a dump file there.)
 */
class JniCheckTest {
  @Test
  @Timeout(300)
  void theGlueIsCleanUnderXcheckJni() throws IOException, InterruptedException {
    String java = Path.of(System.getProperty("java.home"), "bin", "java").toString();
    List<String> command = new ArrayList<>();
    command.add(java);
    command.add("-Xcheck:jni");
    command.add("--enable-native-access=ALL-UNNAMED"); // JDK 24+ warns about System.load without
    command.add("-Dkvrouter.source.dir=" + System.getProperty("kvrouter.source.dir", "../.."));
    command.add(
        "-Dkvrouter.native.build="
            + System.getProperty("kvrouter.native.build", "target/native/build"));
    command.add("-cp");
    command.add(System.getProperty("java.class.path"));
    command.add(JniExercise.class.getName());
    Process child = new ProcessBuilder(command).redirectErrorStream(true).start();
    byte[] out = child.getInputStream().readAllBytes();
    assertTrue(child.waitFor(60, TimeUnit.SECONDS));
    String output = new String(out, StandardCharsets.UTF_8);
    assertEquals(0, child.exitValue(), output);
    assertTrue(output.contains("JNI exercise OK"), output);
    List<String> complaints = new ArrayList<>();
    for (String line : output.split("\n")) {
      String l = line.toLowerCase();
      // libnats sets SIGPIPE to SIG_IGN when first used, and -Xcheck:jni's signal checks
      // report that change of the JVM's handler: not a misuse of JNI by the glue.
      if (line.startsWith("Warning: SIGPIPE handler modified!")) continue;
      if (l.contains("warning") || l.contains("fatal error") || l.contains("jni local refs")) {
        complaints.add(line);
      }
    }
    assertEquals(List.of(), complaints, output);
  }
}
