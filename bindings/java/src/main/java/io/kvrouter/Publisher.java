package io.kvrouter;

import java.util.Objects;

/**
 * A blocking connection to a kvrouter stream listener ({@code kvr_publisher}), for engines
 * publishing their KV events: each send is one length-prefixed EventBatch frame.
 *
 * <p>The C object is not thread-safe; this class serialises sends on the publisher (and on the
 * batch being sent).
 */
public final class Publisher extends NativeObject {
  private Publisher(long handle) {
    super(new NativeResource(handle, Native::publisherFree, null));
  }

  /**
   * Connects to "tcp://HOST:PORT" or "unix://PATH".
   *
   * @throws KvRouterException {@link Status#UNAVAILABLE} if the connection fails, {@link
   *     Status#INVALID_ARGUMENT} for a bad endpoint
   */
  public static Publisher connect(String endpoint) {
    Objects.requireNonNull(endpoint, "endpoint");
    return new Publisher(Native.publisherConnect(endpoint));
  }

  /**
   * Encodes the batch's events and sends them as one frame (the batch keeps them).
   *
   * @throws KvRouterException {@link Status#UNAVAILABLE} if the connection is lost
   */
  public synchronized void send(EventBatch batch) {
    Objects.requireNonNull(batch, "batch");
    long h = acquire();
    try {
      synchronized (batch) {
        long b = batch.acquire();
        try {
          Native.publisherSend(h, b);
        } finally {
          batch.release();
        }
      }
    } finally {
      release();
    }
  }

  /** Sends an already encoded EventBatch as one frame (the length header is added). */
  public void sendEncoded(byte[] batch) {
    sendEncoded(batch, 0, batch.length);
  }

  public synchronized void sendEncoded(byte[] batch, int offset, int length) {
    Objects.checkFromIndexSize(offset, length, batch.length);
    long h = acquire();
    try {
      Native.publisherSendEncoded(h, batch, offset, length);
    } finally {
      release();
    }
  }
}
