package io.kvrouter;

import static io.kvrouter.TestSupport.routerWithWorkers;
import static io.kvrouter.TestSupport.stored;
import static io.kvrouter.TestSupport.tokens;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.IntBuffer;
import org.junit.jupiter.api.Test;

/**
 * The lean routing paths of issue 16: prompts in a direct IntBuffer (read in place, also for
 * admitted calls), and options that set nothing but the flags and strings (passed as arguments).
 * Each must decide exactly as the general path does.
 */
class DirectTokensTest {
  private static IntBuffer direct(int[] t, int pad) {
    IntBuffer b =
        ByteBuffer.allocateDirect(4 * (t.length + 2 * pad))
            .order(ByteOrder.nativeOrder())
            .asIntBuffer();
    b.position(pad);
    b.put(t);
    b.position(pad); // the prompt is the buffer's remaining ints, from its position
    b.limit(pad + t.length);
    return b;
  }

  @Test
  void directBufferRoutesAsTheArray() {
    try (Router router = routerWithWorkers(3)) {
      int[] p = tokens(64, 1);
      router.applyStored(stored(2, p, 3, 100));
      IntBuffer b = direct(p, 5);
      RouteResult fromArray = router.findBestMatch(p);
      RouteResult fromBuffer = router.findBestMatch(b, null);
      assertEquals(fromArray, fromBuffer);
      assertEquals(2, fromBuffer.workerId());
      assertEquals(5, b.position(), "the position is left alone");
      // Admitted: booked under the id, and the id is then taken.
      RouteResult booked = router.findBestMatch(b, RequestOptions.admit("d-1"));
      assertTrue(booked.booked());
      KvRouterException again =
          assertThrows(
              KvRouterException.class,
              () -> router.findBestMatch(b, RequestOptions.admit("d-1")));
      assertEquals(Status.ALREADY_EXISTS, again.status());
      router.freeRequest("d-1");
      // With candidates and general options (the path that reads RequestOptions' fields).
      RequestOptions general =
          RequestOptions.builder().requestId("d-2").admit(true).temperature(0.0).build();
      RouteResult withCandidates = router.findBestMatch(b, general, 8);
      assertTrue(withCandidates.booked());
      assertEquals(3, withCandidates.totalCandidates());
      router.freeRequest("d-2");
      // An empty buffer is an empty prompt, as an empty array is.
      RouteResult none = router.findBestMatch(direct(new int[0], 0), null);
      assertEquals(router.findBestMatch(new int[0]), none);
    }
  }

  @Test
  void heapOrForeignOrderBuffersAreRefused() {
    try (Router router = routerWithWorkers(1)) {
      assertThrows(
          IllegalArgumentException.class,
          () -> router.findBestMatch(IntBuffer.wrap(tokens(16, 1)), null));
      IntBuffer swapped =
          ByteBuffer.allocateDirect(64)
              .order(
                  ByteOrder.nativeOrder() == ByteOrder.BIG_ENDIAN
                      ? ByteOrder.LITTLE_ENDIAN
                      : ByteOrder.BIG_ENDIAN)
              .asIntBuffer();
      assertThrows(IllegalArgumentException.class, () -> router.findBestMatch(swapped, null));
    }
  }

  @Test
  void simpleOptionsRouteAsGeneralOnes() {
    try (Router a = routerWithWorkers(4);
        Router b = routerWithWorkers(4)) {
      int[] p = tokens(48, 7);
      a.applyStored(stored(3, p, 2, 10));
      b.applyStored(stored(3, p, 2, 10));
      RequestOptions simple =
          RequestOptions.builder().requestId("s-1").admit(true).loraName("lora-ä").build();
      assertTrue(simple.simpleFlags() >= 0);
      // Equal options that take the general path (a candidate list forces it).
      RouteResult lean = a.findBestMatch(p, simple);
      RouteResult general = b.findBestMatch(p, simple, 4);
      assertEquals(lean.workerId(), general.workerId());
      assertEquals(lean.deviceOverlapBlocks(), general.deviceOverlapBlocks());
      assertTrue(lean.booked() && general.booked());
      assertFalse(RequestOptions.builder().temperature(0.5).build().simpleFlags() >= 0);
      assertFalse(RequestOptions.builder().allowedWorkerIds(1).build().simpleFlags() >= 0);
      assertThrows(
          IllegalArgumentException.class, () -> a.findBestMatch(p, RequestOptions.admit("a\0b")));
    }
  }
}
