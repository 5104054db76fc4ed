package io.kvrouter;

import java.util.Objects;

/**
 * A vLLM or SGLang engine publishing KV events over ZMQ PUB ({@code kvr_engine_worker}), for {@link
 * Ingest#addEngineWorker(EngineWorker)}. Immutable; from the library's defaults.
 */
public final class EngineWorker {
  final long[] scalars; // kvr_engine_worker in the slots of Abi.EngineWorker
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
    return new Builder(Native.engineWorkerDefaults()).endpoint(endpoint).workerId(workerId);
  }

  public String endpoint() {
    return endpoint;
  }

  public long workerId() {
    return scalars[Abi.EngineWorker.WORKER_ID];
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
      scalars[Abi.EngineWorker.ENGINE] = engine.code();
      return this;
    }

    /** Rank dp_start + r is on port + r (tcp) or ENDPOINT_dp&lt;r&gt; (other transports). */
    public Builder endpoint(String endpoint) {
      this.endpoint = endpoint;
      return this;
    }

    public Builder workerId(long workerId) {
      scalars[Abi.EngineWorker.WORKER_ID] = workerId;
      return this;
    }

    public Builder dpStart(int dpStart) {
      scalars[Abi.EngineWorker.DP_START] = Integer.toUnsignedLong(dpStart);
      return this;
    }

    public Builder dpSize(int dpSize) {
      scalars[Abi.EngineWorker.DP_SIZE] = Integer.toUnsignedLong(dpSize);
      return this;
    }

    /** 0 (default) = the router's; anything else must equal it. */
    public Builder blockSize(int blockSize) {
      scalars[Abi.EngineWorker.BLOCK_SIZE] = Integer.toUnsignedLong(blockSize);
      return this;
    }

    public Builder eagle(boolean eagle) {
      int f = Abi.EngineWorker.FLAGS;
      scalars[f] = eagle ? (scalars[f] | Abi.STORED_EAGLE) : (scalars[f] & ~Abi.STORED_EAGLE);
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
