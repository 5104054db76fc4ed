package io.kvrouter;

/**
 * Where a request may or should run ({@code kvr_routing_hints}): per-phase worker pins, as Dynamo's
 * RoutingHints, and session affinity. Immutable; {@link #builder()} starts from the library's
 * defaults (aggregated, no pin, no session, hard affinity, TTL 300 s).
 *
 * <p>Pins by phase: aggregated uses {@code workerId}/{@code dpRank}; prefill {@code
 * prefillWorkerId} (else workerId) with {@code prefillDpRank} (else dpRank); decode {@code
 * decodeWorkerId} (else workerId) with dpRank. A pin without a rank takes the best of the worker's
 * ranks.
 */
public final class RoutingHints {
  /** KVR_WORKER_NONE: no pin. */
  public static final long NO_WORKER = -1L;

  // Read by the JNI glue: keep the names and types. scalars: phase, worker_id,
  // prefill_worker_id, decode_worker_id, dp_rank, prefill_dp_rank, session_mode,
  // session_ttl_seconds (raw bits).
  final long[] scalars;
  final String sessionId;

  private RoutingHints(long[] scalars, String sessionId) {
    this.scalars = scalars;
    this.sessionId = sessionId;
  }

  public static Builder builder() {
    return new Builder(Defaults.ROUTING_HINTS.clone());
  }

  /** Pins the aggregated phase to a worker (any of its ranks). */
  public static RoutingHints pin(long workerId) {
    return builder().workerId(workerId).build();
  }

  /** Hard affinity to the rank the session is bound to. */
  public static RoutingHints session(String sessionId) {
    return builder().sessionId(sessionId).build();
  }

  public Builder toBuilder() {
    return new Builder(scalars.clone()).sessionId(sessionId);
  }

  public Phase phase() {
    return Phase.of((int) scalars[0]);
  }

  /** {@link #NO_WORKER} when not pinned. */
  public long workerId() {
    return scalars[1];
  }

  public long prefillWorkerId() {
    return scalars[2];
  }

  public long decodeWorkerId() {
    return scalars[3];
  }

  /** -1 = any rank of the pinned worker. */
  public int dpRank() {
    return (int) scalars[4];
  }

  public int prefillDpRank() {
    return (int) scalars[5];
  }

  public String sessionId() {
    return sessionId;
  }

  public SessionMode sessionMode() {
    return SessionMode.of((int) scalars[6]);
  }

  public double sessionTtlSeconds() {
    return Native.dbl(scalars[7]);
  }

  /** Builds {@link RoutingHints}. */
  public static final class Builder {
    private final long[] s;
    private String sessionId;

    private Builder(long[] scalars) {
      this.s = scalars;
    }

    public Builder phase(Phase phase) {
      s[0] = phase.code();
      return this;
    }

    /** {@link #NO_WORKER} = no pin. */
    public Builder workerId(long workerId) {
      s[1] = workerId;
      return this;
    }

    public Builder prefillWorkerId(long workerId) {
      s[2] = workerId;
      return this;
    }

    public Builder decodeWorkerId(long workerId) {
      s[3] = workerId;
      return this;
    }

    /** -1 = any rank. */
    public Builder dpRank(int dpRank) {
      s[4] = dpRank;
      return this;
    }

    public Builder prefillDpRank(int dpRank) {
      s[5] = dpRank;
      return this;
    }

    /** null or "" = no session affinity. */
    public Builder sessionId(String sessionId) {
      this.sessionId = sessionId;
      return this;
    }

    public Builder sessionMode(SessionMode mode) {
      s[6] = mode.code();
      return this;
    }

    /** Sliding TTL of the binding; default 300. */
    public Builder sessionTtlSeconds(double seconds) {
      s[7] = Native.bits(seconds);
      return this;
    }

    public RoutingHints build() {
      return new RoutingHints(s.clone(), sessionId);
    }
  }
}
