package io.kvrouter;

/**
 * A native stream listener of an {@link Ingest}.
 *
 * @param sourceId the source's id for {@link Ingest#stats(long)}
 * @param endpoint the endpoint actually bound ("tcp://127.0.0.1:40123" for port 0)
 */
public record Listener(long sourceId, String endpoint) {}
