//go:build cgo

package kvrouter

/*
#include "kvrouter.h"
*/
import "C"

// TierFromMedium maps an engine's "medium" string (GPU, CPU_PINNED, DISK, ...;
// case-insensitive) to a tier (abi_gen.go: Tier, TierDevice, ...); "" and unknown mediums are
// the device, as in Dynamo, and so is a medium holding a NUL byte (which C would read as its
// end). With a library this package does not accept (CheckVersion) it returns TierDevice
// without calling in.
func TierFromMedium(medium string) Tier {
	if CheckVersion() != nil {
		return TierDevice
	}
	var a args
	defer a.release()
	m := a.optStr("medium", medium)
	if a.err() != nil {
		return TierDevice // a NUL byte: no medium C knows (C would read only what precedes it)
	}
	return Tier(C.kvr_tier_from_medium(m))
}

// HashOptions is what changes a prompt's block hashes besides its tokens. The zero value (or
// nil) is the base model with no namespace, no multimodal content and no eagle windows.
type HashOptions struct {
	Eagle          bool   // windows of block_size + 1 tokens, stride block_size
	LoraName       string // "" = base model
	CacheNamespace string // "" = none
	// MultimodalHashes[i] holds the multimodal content hashes of block i (nil = none).
	MultimodalHashes [][]uint64
}

func (o *HashOptions) toC(a *args) *C.kvr_hash_options {
	if o == nil {
		return nil
	}
	c := new(C.kvr_hash_options)
	initHashOptions(c)
	var n int
	c.mm_hashes, c.mm_counts, n = a.mm(o.MultimodalHashes)
	m := cHashOptions{Flags: flagIf(o.Eagle, C.KVR_HASH_EAGLE), MmNumBlocks: uint64(n)}
	m.store(c)
	c.lora_name = a.optStr("HashOptions.LoraName", o.LoraName)
	c.cache_namespace = a.optStr("HashOptions.CacheNamespace", o.CacheNamespace)
	return c
}

// ComputeBlockHashes returns the Dynamo-compatible local hashes (XXH3-64) of every complete
// block of tokens. opts may be nil.
func ComputeBlockHashes(tokens []uint32, blockSize uint32, opts *HashOptions) ([]uint64, error) {
	n := 0
	if blockSize > 0 {
		usable := len(tokens)
		if opts != nil && opts.Eagle && usable > 0 {
			usable--
		}
		n = usable / int(blockSize)
	}
	return computeBlockHashes(tokens, blockSize, opts, n)
}

// computeBlockHashes starts with a buffer of capHint hashes and grows it when the library
// answers KVR_BUFFER_TOO_SMALL.
func computeBlockHashes(tokens []uint32, blockSize uint32, opts *HashOptions, capHint int) ([]uint64, error) {
	if err := CheckVersion(); err != nil {
		return nil, err
	}
	var a args
	defer a.release()
	copts := opts.toC(&a)
	if err := a.err(); err != nil {
		return nil, err
	}
	tp, tn := tokensPtr(tokens)
	hashes, err := fillGrowing(capHint, func(p *C.uint64_t, cap C.size_t, n *C.size_t, cerr **C.kvr_error) C.kvr_status {
		return C.kvr_compute_block_hashes(tp, tn, C.uint32_t(blockSize), copts, p, cap, n, cerr)
	})
	return fromCU64s(hashes), err
}

// ComputeSequenceHashes returns the chained sequence hashes of local block hashes (one per
// input).
func ComputeSequenceHashes(localHashes []uint64) ([]uint64, error) {
	return computeSequenceHashes(localHashes, len(localHashes))
}

func computeSequenceHashes(localHashes []uint64, capHint int) ([]uint64, error) {
	if err := CheckVersion(); err != nil {
		return nil, err
	}
	in, count := u64Ptr(localHashes), C.size_t(len(localHashes))
	hashes, err := fillGrowing(capHint, func(p *C.uint64_t, cap C.size_t, n *C.size_t, cerr **C.kvr_error) C.kvr_status {
		return C.kvr_compute_sequence_hashes(in, count, p, cap, n, cerr)
	})
	return fromCU64s(hashes), err
}
