package io.kvrouter;

/**
 * The library's defaults of the structs whose Java classes the glue reads field by field. Kept out
 * of those classes so that their initialisation never calls into the library (the glue looks their
 * fields up while it loads).
 */
final class Defaults {
  private Defaults() {}

  static final long[] REQUEST_OPTIONS = Native.requestOptionsDefaults();
  static final long[] ROUTING_HINTS = Native.routingHintsDefaults();
}
