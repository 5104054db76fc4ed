package io.kvrouter;

/** A worker and one of its data-parallel ranks (a session's binding). */
public record WorkerRank(long workerId, int dpRank) {}
