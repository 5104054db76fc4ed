package io.kvrouter;

import java.util.Objects;

/**
 * A NATS JetStream stream to consume KV events from ({@code kvr_jetstream_source}), for {@link
 * Ingest#subscribeJetStream(JetStreamSource)}: the messages {@link Ingest#subscribeNats} takes,
 * through a durable consumer, each acknowledged once applied, so that nothing is lost while the
 * ingest or the server is away. Immutable; from the library's defaults (a new consumer from the
 * stream's first message; when created, the stream keeps 1 h and 1 GiB).
 */
public final class JetStreamSource {
  final long[] scalars; // kvr_jetstream_source in the slots of Abi.JetstreamSource
  final String url;
  final String stream;
  final String subject;
  final String durable;

  private JetStreamSource(Builder b) {
    this.scalars = b.scalars.clone();
    this.url = Objects.requireNonNull(b.url, "url");
    this.stream = Objects.requireNonNull(b.stream, "stream");
    this.subject = Objects.requireNonNull(b.subject, "subject");
    this.durable = b.durable;
  }

  /**
   * The stream {@code stream} (no spaces, '.', '*' or '>') on the NATS server at {@code url}
   * ("nats://HOST:PORT"), consuming {@code subject} (wildcards allowed; the stream's own subjects
   * when {@link Builder#createStream} creates it).
   */
  public static Builder builder(String url, String stream, String subject) {
    return new Builder(Native.jetstreamSourceDefaults(), url, stream, subject);
  }

  public String url() {
    return url;
  }

  public String stream() {
    return stream;
  }

  public String subject() {
    return subject;
  }

  /** The durable consumer's name, or null for an ephemeral consumer. */
  public String durable() {
    return durable;
  }

  public long startSequence() {
    return scalars[Abi.JetstreamSource.START_SEQUENCE];
  }

  public boolean resume() {
    return (scalars[Abi.JetstreamSource.FLAGS] & Abi.JETSTREAM_RESUME) != 0;
  }

  public boolean createStream() {
    return (scalars[Abi.JetstreamSource.FLAGS] & Abi.JETSTREAM_CREATE_STREAM) != 0;
  }

  public double maxAgeSeconds() {
    return Double.longBitsToDouble(scalars[Abi.JetstreamSource.MAX_AGE_SECONDS]);
  }

  public long maxBytes() {
    return scalars[Abi.JetstreamSource.MAX_BYTES];
  }

  /** Builds {@link JetStreamSource}. */
  public static final class Builder {
    private final long[] scalars;
    private final String url;
    private final String stream;
    private final String subject;
    private String durable;

    private Builder(long[] defaults, String url, String stream, String subject) {
      this.scalars = defaults;
      this.url = url;
      this.stream = stream;
      this.subject = subject;
    }

    /**
     * The durable consumer's name, one per router (rules as the stream's); null or "" (default) =
     * an ephemeral consumer, deleted when the source goes away.
     */
    public Builder durable(String durable) {
      this.durable = durable;
      return this;
    }

    /**
     * The first stream sequence delivered; 0 (default) = the stream's first message. After
     * restoring a snapshot taken when {@link IngestStats#streamSequence()} was N: N + 1. Without
     * {@link #resume}, an existing durable consumer of that name is replaced.
     */
    public Builder startSequence(long startSequence) {
      scalars[Abi.JetstreamSource.START_SEQUENCE] = startSequence;
      return this;
    }

    /** An existing durable consumer keeps its position ({@code KVR_JETSTREAM_RESUME}). */
    public Builder resume(boolean resume) {
      return flag(Abi.JETSTREAM_RESUME, resume);
    }

    /**
     * Creates the stream if absent, with the limits below ({@code KVR_JETSTREAM_CREATE_STREAM}).
     */
    public Builder createStream(boolean createStream) {
      return flag(Abi.JETSTREAM_CREATE_STREAM, createStream);
    }

    /** With {@link #createStream}: messages older are dropped; default 3600; 0 = no limit. */
    public Builder maxAgeSeconds(double maxAgeSeconds) {
      scalars[Abi.JetstreamSource.MAX_AGE_SECONDS] = Double.doubleToRawLongBits(maxAgeSeconds);
      return this;
    }

    /**
     * With {@link #createStream}: the oldest messages are dropped beyond this many bytes; default
     * 1 GiB; -1 = no limit.
     */
    public Builder maxBytes(long maxBytes) {
      scalars[Abi.JetstreamSource.MAX_BYTES] = maxBytes;
      return this;
    }

    private Builder flag(int flag, boolean on) {
      int f = Abi.JetstreamSource.FLAGS;
      scalars[f] = on ? (scalars[f] | flag) : (scalars[f] & ~flag);
      return this;
    }

    public JetStreamSource build() {
      return new JetStreamSource(this);
    }
  }
}
