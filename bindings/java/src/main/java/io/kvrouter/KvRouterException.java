package io.kvrouter;

/**
 * A kvrouter call failed: the C function returned a status other than {@code KVR_OK}. Carries the
 * status and the library's message. Unchecked, like the failures of {@code java.io}'s unchecked
 * cousins: a router call fails for a reason the caller usually handles by status ({@link
 * Status#NOT_FOUND}, {@link Status#ALREADY_EXISTS}, {@link Status#UNAVAILABLE}, ...).
 */
public class KvRouterException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  private final int code;

  /** Called by the JNI glue. */
  KvRouterException(int code, String message) {
    super(message);
    this.code = code;
  }

  /** The status; {@link Status#UNKNOWN} for a code this binding does not know. */
  public Status status() {
    return Status.of(code);
  }

  /** The C status value. */
  public int code() {
    return code;
  }

  @Override
  public String toString() {
    return getClass().getName()
        + ": ["
        + status()
        + (status() == Status.UNKNOWN ? " " + code : "")
        + "] "
        + getMessage();
  }
}
