package io.kvrouter;

/**
 * kvrouter's status codes ({@code kvr_status}). Codes below 100 are {@code absl::StatusCode}'s
 * numbers and never change meaning; a code this binding does not know maps to {@link #UNKNOWN} (the
 * exception still carries the number).
 */
public enum Status {
  OK(0),
  CANCELLED(1),
  INVALID_ARGUMENT(3),
  DEADLINE_EXCEEDED(4),
  NOT_FOUND(5),
  ALREADY_EXISTS(6),
  RESOURCE_EXHAUSTED(8),
  FAILED_PRECONDITION(9),
  UNIMPLEMENTED(12),
  INTERNAL(13),
  UNAVAILABLE(14),
  /** A caller buffer was too small (the binding sizes its buffers, so rarely seen). */
  BUFFER_TOO_SMALL(100),
  /** A code newer than this binding. */
  UNKNOWN(-1);

  private final int code;

  Status(int code) {
    this.code = code;
  }

  /** The C value. */
  public int code() {
    return code;
  }

  /** The status with this C value, or {@link #UNKNOWN}. */
  public static Status of(int code) {
    for (Status status : values()) {
      if (status.code == code) return status;
    }
    return UNKNOWN;
  }

  /** The C name, as {@code kvr_status_str} gives it ("KVR_NOT_FOUND"). */
  public String cName() {
    return KvRouter.statusName(code);
  }
}
