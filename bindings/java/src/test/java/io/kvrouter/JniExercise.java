package io.kvrouter;

import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Method;
import java.lang.reflect.Modifier;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.List;
import org.junit.jupiter.api.Test;

/**
 * Runs the test methods of the other test classes, without JUnit's launcher, in a JVM of its own:
 * {@link JniCheckTest} starts it with {@code -Xcheck:jni} and reads what the JVM says about the
 * glue.
 */
public final class JniExercise {
  private JniExercise() {}

  static final List<Class<?>> CLASSES =
      List.of(
          LibraryTest.class,
          AbiTest.class,
          RouterTest.class,
          PrehashedPromptTest.class,
          StagedRoutingTest.class,
          DisaggTest.class,
          IngestTest.class,
          ReplicaTest.class,
          ConcurrencyTest.class,
          PredictedTtftTest.class);

  public static void main(String[] args) throws Exception {
    int ran = 0;
    for (Class<?> cls : CLASSES) {
      var ctor = cls.getDeclaredConstructor();
      ctor.setAccessible(true);
      for (Method m : cls.getDeclaredMethods()) {
        if (!m.isAnnotationPresent(Test.class) || Modifier.isStatic(m.getModifiers())) continue;
        Object[] params = new Object[m.getParameterCount()];
        Path temp = null;
        for (int i = 0; i < params.length; ++i) {
          if (m.getParameterTypes()[i] != Path.class) throw new IllegalStateException(m.toString());
          temp = Files.createTempDirectory("kvrouter-jni");
          params[i] = temp;
        }
        m.setAccessible(true);
        try {
          m.invoke(ctor.newInstance(), params);
        } catch (InvocationTargetException e) {
          System.out.println("FAILED " + cls.getSimpleName() + "." + m.getName());
          throw (Exception) (e.getCause() instanceof Exception ? e.getCause() : e);
        } finally {
          if (temp != null) {
            try (var files = Files.walk(temp)) {
              files.sorted(java.util.Comparator.reverseOrder()).forEach(p -> p.toFile().delete());
            }
          }
        }
        ++ran;
      }
    }
    System.out.println("JNI exercise OK: " + ran + " test methods");
  }
}
