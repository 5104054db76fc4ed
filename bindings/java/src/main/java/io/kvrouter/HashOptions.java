package io.kvrouter;

import java.util.Objects;

/**
 * What changes a prompt's block hashes besides its tokens ({@code kvr_hash_options}): a LoRA
 * adapter, a cache namespace, multimodal content, eagle windows. Immutable; build with {@link
 * #builder()}.
 */
public final class HashOptions {
  private static final HashOptions NONE = builder().build();

  final boolean eagle;
  final String loraName;
  final String cacheNamespace;
  final long[] mmHashes;
  final int[] mmCounts;

  private HashOptions(Builder b) {
    this.eagle = b.eagle;
    this.loraName = b.loraName;
    this.cacheNamespace = b.cacheNamespace;
    this.mmHashes = b.mmHashes;
    this.mmCounts = b.mmCounts;
  }

  /** No LoRA, no namespace, no multimodal content, no eagle windows. */
  public static HashOptions none() {
    return NONE;
  }

  public static Builder builder() {
    return new Builder();
  }

  public boolean eagle() {
    return eagle;
  }

  public String loraName() {
    return loraName;
  }

  public String cacheNamespace() {
    return cacheNamespace;
  }

  /** Builds {@link HashOptions}. */
  public static final class Builder {
    private boolean eagle;
    private String loraName;
    private String cacheNamespace;
    private long[] mmHashes;
    private int[] mmCounts;

    private Builder() {}

    /** Windows of block_size + 1 tokens with stride block_size (KVR_HASH_EAGLE). */
    public Builder eagle(boolean eagle) {
      this.eagle = eagle;
      return this;
    }

    /** null or "" = the base model. */
    public Builder loraName(String loraName) {
      this.loraName = loraName;
      return this;
    }

    /** null or "" = none. */
    public Builder cacheNamespace(String cacheNamespace) {
      this.cacheNamespace = cacheNamespace;
      return this;
    }

    /**
     * Multimodal hashes: block i owns the next {@code counts[i]} values of {@code hashes}. Both
     * null = no multimodal content. The arrays are copied.
     */
    public Builder multimodal(long[] hashes, int[] counts) {
      if ((hashes == null) != (counts == null)) {
        throw new IllegalArgumentException("multimodal hashes and counts go together");
      }
      this.mmHashes = hashes == null ? null : hashes.clone();
      this.mmCounts = counts == null ? null : counts.clone();
      return this;
    }

    public HashOptions build() {
      return new HashOptions(this);
    }
  }

  @Override
  public String toString() {
    return "HashOptions{eagle="
        + eagle
        + ", lora="
        + Objects.toString(loraName, "")
        + ", namespace="
        + Objects.toString(cacheNamespace, "")
        + "}";
  }
}
