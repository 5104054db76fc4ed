package io.kvrouter;

import java.util.Objects;

/**
 * A vLLM or SGLang engine publishing KV events over ZMQ PUB ({@code kvr_engine_worker}), for {@link
 * Ingest#addEngineWorker(EngineWorker)}. Immutable; from the library's defaults.
 */
public final class EngineWorker {
  static final int FLAG_EAGLE = 0x2; // KVR_STORED_EAGLE

  final long[] scalars; // engine, worker_id, dp_start, dp_size, block_size, flags
  final String endpoint;
  final String topic;
  final String replayEndpoint;

  private EngineWorker(Builder b) {
    this.scalars = b.scalars.clone();
    this.endpoint = Objects.requireNonNull(b.endpoint, "endpoint");
    this.topic = b.topic;
    this.replayEndpoint = b.replayEndpoint;
  }

  /** Worker {@code workerId} publishing on {@code endpoint} ("tcp://10.0.0.5:5557"). */
  public static Builder builder(String endpoint, long workerId) {
    return new Builder(Native.defaults(Native.DEFAULTS_ENGINE_WORKER, Native.ENGINE_WORKER_LEN))
        .endpoint(endpoint)
        .workerId(workerId);
  }

  public String endpoint() {
    return endpoint;
  }

  public long workerId() {
    return scalars[1];
  }

  /** Builds {@link EngineWorker}. */
  public static final class Builder {
    private final long[] scalars;
    private String endpoint;
    private String topic;
    private String replayEndpoint;

    private Builder(long[] defaults) {
      this.scalars = defaults;
    }

    public Builder engine(EngineKind engine) {
      scalars[0] = engine.code();
      return this;
    }

    /** Rank dp_start + r is on port + r (tcp) or ENDPOINT_dp&lt;r&gt; (other transports). */
    public Builder endpoint(String endpoint) {
      this.endpoint = endpoint;
      return this;
    }

    public Builder workerId(long workerId) {
      scalars[1] = workerId;
      return this;
    }

    public Builder dpStart(int dpStart) {
      scalars[2] = Integer.toUnsignedLong(dpStart);
      return this;
    }

    public Builder dpSize(int dpSize) {
      scalars[3] = Integer.toUnsignedLong(dpSize);
      return this;
    }

    /** 0 (default) = the router's; anything else must equal it. */
    public Builder blockSize(int blockSize) {
      scalars[4] = Integer.toUnsignedLong(blockSize);
      return this;
    }

    public Builder eagle(boolean eagle) {
      scalars[5] = eagle ? (scalars[5] | FLAG_EAGLE) : (scalars[5] & ~FLAG_EAGLE);
      return this;
    }

    /** Subscription prefix; null or "" = every message. */
    public Builder topic(String topic) {
      this.topic = topic;
      return this;
    }

    /** vLLM's replay socket, or null: missed messages then clear the worker. */
    public Builder replayEndpoint(String replayEndpoint) {
      this.replayEndpoint = replayEndpoint;
      return this;
    }

    public EngineWorker build() {
      return new EngineWorker(this);
    }
  }
}
