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
  public static final long NO_WORKER = Abi.WORKER_NONE;

  // Read by the JNI glue: keep the names and types. scalars: kvr_routing_hints in the slots of
  // Abi.RoutingHints (session_ttl_seconds as raw bits).
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
    return Phase.of((int) scalars[Abi.RoutingHints.PHASE]);
  }

  /** {@link #NO_WORKER} when not pinned. */
  public long workerId() {
    return scalars[Abi.RoutingHints.WORKER_ID];
  }

  public long prefillWorkerId() {
    return scalars[Abi.RoutingHints.PREFILL_WORKER_ID];
  }

  public long decodeWorkerId() {
    return scalars[Abi.RoutingHints.DECODE_WORKER_ID];
  }

  /** -1 = any rank of the pinned worker. */
  public int dpRank() {
    return (int) scalars[Abi.RoutingHints.DP_RANK];
  }

  public int prefillDpRank() {
    return (int) scalars[Abi.RoutingHints.PREFILL_DP_RANK];
  }

  public String sessionId() {
    return sessionId;
  }

  public SessionMode sessionMode() {
    return SessionMode.of((int) scalars[Abi.RoutingHints.SESSION_MODE]);
  }

  public double sessionTtlSeconds() {
    return Native.dbl(scalars[Abi.RoutingHints.SESSION_TTL_SECONDS]);
  }

  /** Builds {@link RoutingHints}. */
  public static final class Builder {
    private final long[] s;
    private String sessionId;

    private Builder(long[] scalars) {
      this.s = scalars;
    }

    public Builder phase(Phase phase) {
      s[Abi.RoutingHints.PHASE] = phase.code();
      return this;
    }

    /** {@link #NO_WORKER} = no pin. */
    public Builder workerId(long workerId) {
      s[Abi.RoutingHints.WORKER_ID] = workerId;
      return this;
    }

    public Builder prefillWorkerId(long workerId) {
      s[Abi.RoutingHints.PREFILL_WORKER_ID] = workerId;
      return this;
    }

    public Builder decodeWorkerId(long workerId) {
      s[Abi.RoutingHints.DECODE_WORKER_ID] = workerId;
      return this;
    }

    /** -1 = any rank. */
    public Builder dpRank(int dpRank) {
      s[Abi.RoutingHints.DP_RANK] = dpRank;
      return this;
    }

    public Builder prefillDpRank(int dpRank) {
      s[Abi.RoutingHints.PREFILL_DP_RANK] = dpRank;
      return this;
    }

    /** null or "" = no session affinity. */
    public Builder sessionId(String sessionId) {
      this.sessionId = sessionId;
      return this;
    }

    public Builder sessionMode(SessionMode mode) {
      s[Abi.RoutingHints.SESSION_MODE] = mode.code();
      return this;
    }

    /** Sliding TTL of the binding; default 300. */
    public Builder sessionTtlSeconds(double seconds) {
      s[Abi.RoutingHints.SESSION_TTL_SECONDS] = Native.bits(seconds);
      return this;
    }

    public RoutingHints build() {
      return new RoutingHints(s.clone(), sessionId);
    }
  }
}
