package kvrouter

import (
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestVersion(t *testing.T) {
	if Version() != HeaderVersionNumber {
		t.Errorf("library %d, header %d", Version(), HeaderVersionNumber)
	}
	want := strconv.Itoa(HeaderVersionMajor) + "." + strconv.Itoa(HeaderVersionMinor) + "." +
		strconv.Itoa(HeaderVersionPatch)
	if VersionString() != want {
		t.Errorf("VersionString() = %q, want %q", VersionString(), want)
	}
	must(t, CheckVersion())
}

func TestStatus(t *testing.T) {
	if ErrNotFound.String() != "KVR_NOT_FOUND" || ErrBufferTooSmall.String() != "KVR_BUFFER_TOO_SMALL" {
		t.Errorf("names: %v %v", ErrNotFound, ErrBufferTooSmall)
	}
	if Status(4242).String() != "KVR_UNKNOWN" {
		t.Errorf("unknown code: %v", Status(4242).String())
	}
	if StatusOf(nil) != StatusOK || StatusOf(errors.New("x")) != -1 {
		t.Error("StatusOf")
	}
	err := newError(ErrNotFound, "worker 9")
	if !errors.Is(err, ErrNotFound) || errors.Is(err, ErrAlreadyExists) {
		t.Error("errors.Is on codes")
	}
	if err.Error() != "kvrouter: KVR_NOT_FOUND: worker 9" {
		t.Errorf("Error() = %q", err.Error())
	}
	if !errors.Is(ErrClosed, ErrFailedPrecondition) {
		t.Error("ErrClosed carries KVR_FAILED_PRECONDITION")
	}
}

// The hashing functions reproduce every vector of data/vectors/dynamo_block_hash_vectors.json.
func TestHashVectors(t *testing.T) {
	path := filepath.Join("..", "..", "data", "vectors", "dynamo_block_hash_vectors.json")
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Skipf("no hash vectors in this tree (%v)", err)
	}
	var file struct {
		Vectors []struct {
			Name      string     `json:"name"`
			Tokens    []uint32   `json:"tokens"`
			BlockSize uint32     `json:"block_size"`
			Lora      string     `json:"lora"`
			NS        string     `json:"ns"`
			MM        [][]uint64 `json:"mm"`
			Eagle     bool       `json:"eagle"`
			Local     []string   `json:"local_hashes"`
			Sequence  []string   `json:"sequence_hashes"`
		} `json:"vectors"`
	}
	must(t, json.Unmarshal(raw, &file))
	if len(file.Vectors) == 0 {
		t.Fatal("no vectors")
	}
	parse := func(s []string) []uint64 {
		out := make([]uint64, len(s))
		for i, v := range s {
			out[i], err = strconv.ParseUint(v, 10, 64)
			must(t, err)
		}
		return out
	}
	for _, v := range file.Vectors {
		opts := &HashOptions{Eagle: v.Eagle, LoraName: v.Lora, CacheNamespace: v.NS, MultimodalHashes: v.MM}
		local, err := ComputeBlockHashes(v.Tokens, v.BlockSize, opts)
		must(t, err)
		if want := parse(v.Local); !equalU64(local, want) {
			t.Errorf("%s: local %v, want %v", v.Name, local, want)
		}
		seq, err := ComputeSequenceHashes(local)
		must(t, err)
		if want := parse(v.Sequence); !equalU64(seq, want) {
			t.Errorf("%s: sequence %v, want %v", v.Name, seq, want)
		}
	}
}

func equalU64(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestHashing(t *testing.T) {
	p := prompt(100, 5)
	h, err := ComputeBlockHashes(p, bs, nil)
	must(t, err)
	if len(h) != 6 {
		t.Fatalf("%d hashes for 100 tokens of 16, want 6", len(h))
	}
	short, err := ComputeBlockHashes(p[:40], bs, &HashOptions{})
	must(t, err)
	if !equalU64(short, h[:2]) {
		t.Error("a prefix's hashes are a prefix of the hashes")
	}
	lora, err := ComputeBlockHashes(p, bs, &HashOptions{LoraName: "adapter"})
	must(t, err)
	if lora[0] == h[0] {
		t.Error("a LoRA name salts the hashes")
	}
	eagle, err := ComputeBlockHashes(p[:32], bs, &HashOptions{Eagle: true})
	must(t, err)
	if len(eagle) != 1 {
		t.Errorf("eagle: %d hashes of 32 tokens, want 1 (one look-ahead token each)", len(eagle))
	}
	// The growth path: no room at first, the library says how much, the call is retried.
	grown, err := computeBlockHashes(p, bs, nil, 0)
	must(t, err)
	if !equalU64(grown, h) {
		t.Error("retry after KVR_BUFFER_TOO_SMALL gave other hashes")
	}
	seqGrown, err := computeSequenceHashes(h, 1)
	must(t, err)
	seq, err := ComputeSequenceHashes(h)
	must(t, err)
	if !equalU64(seq, seqGrown) || seq[0] != h[0] || seq[1] == h[1] {
		t.Error("sequence hashes")
	}
	_, err = ComputeBlockHashes(p, 0, nil)
	wantCode(t, err, ErrInvalidArgument)
	none, err := ComputeBlockHashes(nil, bs, nil)
	if err != nil || len(none) != 0 {
		t.Errorf("no tokens: %v %v", none, err)
	}
	if TierFromMedium("cpu_pinned") != TierHostPinned || TierFromMedium("DISK") != TierDisk ||
		TierFromMedium("") != TierDevice || TierFromMedium("tape") != TierDevice {
		t.Error("TierFromMedium")
	}
}

func TestRouterOptions(t *testing.T) {
	d := DefaultRouterOptions()
	if d.BlockSize != 16 || d.OverlapScoreCredit != 1 || d.HostCacheHitWeight != 0.75 ||
		d.DiskCacheHitWeight != 0.25 || d.QueueThreshold >= 0 || d.ApproxTTL.Seconds() != 120 ||
		d.ApproxMaxBlocks != 1<<20 || d.RequestExpiry.Seconds() != 300 {
		t.Errorf("defaults: %+v", d)
	}
	r, err := NewRouter(nil)
	must(t, err)
	r.Close()
	bad := DefaultRouterOptions()
	bad.BlockSize = 0
	_, err = NewRouter(&bad)
	wantCode(t, err, ErrInvalidArgument)
	bad = DefaultRouterOptions()
	bad.Temperature = -1
	_, err = NewRouter(&bad)
	wantCode(t, err, ErrInvalidArgument)
}

// A router whose index splits the workers over 4 trees answers as the default single tree
// does after the same events (stores on 9 workers sharing a stem, a removal, a worker leaving):
// the same overlaps, choices and index size. Out of range is refused naming the field, 0
// included (a zero field is sent as 0, not read as the default).
func TestIndexShards(t *testing.T) {
	if d := DefaultRouterOptions(); d.IndexShards != 1 {
		t.Fatalf("default IndexShards %d, want 1", d.IndexShards)
	}
	for _, shards := range []uint32{0, 65} {
		opts := DefaultRouterOptions()
		opts.IndexShards = shards
		_, err := NewRouter(&opts)
		wantCode(t, err, ErrInvalidArgument)
		if !strings.Contains(err.Error(), "index_shards") {
			t.Errorf("IndexShards %d refused as %q, which does not name index_shards", shards, err)
		}
	}

	const workers = 9
	single := indexShardsRouter(t, DefaultRouterOptions().IndexShards)
	sharded := indexShardsRouter(t, 4)
	// Every worker holds a 4-block stem, then 2 blocks of its own.
	prompts := make(map[uint64][]uint32, workers)
	for w := uint64(1); w <= workers; w++ {
		prompts[w] = append(prompt(4*bs, 7), prompt(2*bs, uint32(1000*w))...)
	}
	for _, r := range []*Router{single, sharded} {
		for w := uint64(1); w <= workers; w++ {
			must(t, r.AddWorker(WorkerConfig{WorkerID: w}))
			must(t, r.ApplyStored(storedPrefix(w, prompts[w], 6)))
		}
		must(t, r.ApplyRemoved(&RemovedEvent{WorkerID: 2, BlockHashes: []uint64{2<<32 | 6}}))
		must(t, r.RemoveWorker(4))
	}

	for w := uint64(1); w <= workers; w++ {
		want := sortedOverlaps(t, single, prompts[w])
		if got := sortedOverlaps(t, sharded, prompts[w]); !reflect.DeepEqual(got, want) {
			t.Errorf("prompt of worker %d: overlaps with 4 trees %+v, with 1 %+v", w, got, want)
		}
		if held := overlapDevice(want); !reflect.DeepEqual(held, expectedHeld(w)) {
			t.Errorf("prompt of worker %d: device blocks %v, want %v", w, held, expectedHeld(w))
		}
		if w == 4 {
			continue // every remaining worker holds the stem only: a random tie-break
		}
		one, err := single.FindBestMatch(prompts[w], nil)
		must(t, err)
		four, err := sharded.FindBestMatch(prompts[w], nil)
		must(t, err)
		if one != four || one.WorkerID != w {
			t.Errorf("prompt of worker %d: routed %+v with 4 trees, %+v with 1", w, four, one)
		}
	}
	m1, err := single.Metrics()
	must(t, err)
	m4, err := sharded.Metrics()
	must(t, err)
	if m1.IndexBlocks != 8*6-1 || m4.IndexBlocks != m1.IndexBlocks {
		t.Errorf("index blocks: %d with 4 trees, %d with 1, want %d", m4.IndexBlocks, m1.IndexBlocks, 8*6-1)
	}
}

// indexShardsRouter is a seeded router (block size bs) whose index has the given trees.
func indexShardsRouter(t *testing.T, shards uint32) *Router {
	t.Helper()
	opts := DefaultRouterOptions()
	opts.BlockSize = bs
	opts.RandomSeed = 7
	opts.IndexShards = shards
	r, err := NewRouter(&opts)
	must(t, err)
	t.Cleanup(func() { r.Close() })
	return r
}

func sortedOverlaps(t *testing.T, r *Router, tokens []uint32) []Overlap {
	t.Helper()
	ov, err := r.OverlapScores(tokens, nil)
	must(t, err)
	sort.Slice(ov, func(i, j int) bool { return ov[i].WorkerID < ov[j].WorkerID })
	return ov
}

// overlapDevice maps each worker in ov to its device blocks.
func overlapDevice(ov []Overlap) map[uint64]uint32 {
	held := make(map[uint64]uint32, len(ov))
	for _, o := range ov {
		held[o.WorkerID] = o.DeviceBlocks
	}
	return held
}

// expectedHeld is what TestIndexShards' workers hold of worker w's prompt: the 4-block stem
// each, all 6 blocks for w itself (5 for worker 2, which evicted its last); worker 4 has left.
func expectedHeld(w uint64) map[uint64]uint32 {
	held := map[uint64]uint32{}
	for v := uint64(1); v <= 9; v++ {
		switch {
		case v == 4:
		case v == w && v == 2:
			held[v] = 5
		case v == w:
			held[v] = 6
		default:
			held[v] = 4
		}
	}
	return held
}

// Routing picks the worker holding the prompt's prefix, and explains why.
func TestRoutingPicksPrefixHolder(t *testing.T) {
	r := newTestRouter(t, 4)
	p := prompt(48, 1000)
	must(t, r.ApplyStored(storedPrefix(2, p, 2)))

	cands := make([]Candidate, 8)
	res, total, err := r.FindBestMatchCandidates(p, nil, cands)
	must(t, err)
	if res.WorkerID != 2 || res.DeviceOverlapBlocks != 2 || res.CachedTokens != 32 ||
		res.PromptBlocks != 3 || res.PromptTokens != 48 || res.Booked {
		t.Fatalf("result %+v", res)
	}
	if total != 4 {
		t.Fatalf("%d candidates, want 4", total)
	}
	chosen := 0
	for _, c := range cands[:total] {
		if c.Chosen {
			chosen++
			if c.WorkerID != 2 || c.DeviceBlocks != 2 || c.Cost != res.Cost || c.Credit != 2 {
				t.Errorf("chosen candidate %+v", c)
			}
		} else if c.DeviceBlocks != 0 || c.Cost <= res.Cost {
			t.Errorf("other candidate %+v (chosen cost %v)", c, res.Cost)
		}
	}
	if chosen != 1 {
		t.Errorf("%d candidates chosen", chosen)
	}
	// Room for one: the decision stands and the total is reported.
	one := make([]Candidate, 1)
	res1, total1, err := r.FindBestMatchCandidates(p, nil, one)
	must(t, err)
	if res1.WorkerID != 2 || total1 != 4 || one[0].WorkerID == 0 {
		t.Errorf("truncated: %+v %d %+v", res1, total1, one[0])
	}
	// Query-only decisions book nothing.
	m, err := r.Metrics()
	must(t, err)
	if m.RequestsActive != 0 || m.Decisions != 2 || m.Workers != 4 {
		t.Errorf("metrics %+v", m)
	}
	// Lower tiers count with their weights: worker 3 holds the same prefix on host memory.
	host := storedPrefix(3, p, 3)
	host.Tier = TierHostPinned
	must(t, r.ApplyStored(host))
	ov, err := r.OverlapScores(p, nil)
	must(t, err)
	// The same prompt hashed by the caller gets the same rows.
	hashes, err := ComputeBlockHashes(p, bs, nil)
	must(t, err)
	hashed, err := r.OverlapScoresOfHashes(hashes, nil)
	must(t, err)
	if !reflect.DeepEqual(hashed, ov) {
		t.Errorf("overlap of hashes %+v, of tokens %+v", hashed, ov)
	}
	found := false
	for _, o := range ov {
		if o.WorkerID == 3 {
			found = true
			if o.HostBlocks != 3 || o.DeviceBlocks != 0 || o.EffectiveOverlapBlocks != 2.25 {
				t.Errorf("host overlap %+v", o)
			}
		}
	}
	if !found {
		t.Errorf("worker 3 missing from %+v", ov)
	}
}

// FindMatches is the index walk of OverlapScoresOfHashes: the same ranks with the same tiers
// and tree sizes, and no rows for no hashes or hashes nobody holds.
func TestFindMatches(t *testing.T) {
	r := newTestRouter(t, 4)
	p := prompt(64, 1)
	// Worker 1: two blocks on the device; worker 2: three on host memory; worker 3: two on the
	// device continued by one on disk; worker 4 holds nothing.
	must(t, r.ApplyStored(storedPrefix(1, p, 2)))
	host := storedPrefix(2, p, 3)
	host.Tier = TierHostPinned
	must(t, r.ApplyStored(host))
	dev := storedPrefix(3, p, 2)
	must(t, r.ApplyStored(dev))
	disk := &StoredEvent{WorkerID: 3, Tier: TierDisk, HasParent: true, ParentHash: dev.BlockHashes[1],
		BlockHashes: []uint64{3<<32 | 3}, TokenIDs: p[2*bs : 3*bs]}
	must(t, r.ApplyStored(disk))
	hashes, err := ComputeBlockHashes(p, bs, nil)
	must(t, err)
	ov, err := r.OverlapScoresOfHashes(hashes, nil)
	must(t, err)
	ms, err := r.FindMatches(hashes)
	must(t, err)
	if len(ms) != 3 || len(ov) != 3 {
		t.Fatalf("%d matches, %d overlaps, want 3 of each: %+v %+v", len(ms), len(ov), ms, ov)
	}
	sort.Slice(ov, func(i, j int) bool { return ov[i].WorkerID < ov[j].WorkerID })
	sort.Slice(ms, func(i, j int) bool { return ms[i].WorkerID < ms[j].WorkerID })
	for i, m := range ms {
		o := ov[i]
		want := Match{WorkerID: o.WorkerID, DPRank: o.DPRank, DeviceBlocks: o.DeviceBlocks, HostBlocks: o.HostBlocks,
			DiskBlocks: o.DiskBlocks, ExternalBlocks: o.ExternalBlocks, TreeSize: o.TreeSize}
		if m != want {
			t.Errorf("match %+v, overlap %+v", m, o)
		}
	}
	want := []Match{
		{WorkerID: 1, DeviceBlocks: 2, TreeSize: 2},
		{WorkerID: 2, HostBlocks: 3, TreeSize: 3},
		{WorkerID: 3, DeviceBlocks: 2, DiskBlocks: 1, TreeSize: 3},
	}
	if !reflect.DeepEqual(ms, want) {
		t.Errorf("matches %+v, want %+v", ms, want)
	}
	// A prefix of the prompt: worker 2 holds one block of it, as do the others.
	short, err := r.FindMatches(hashes[:1])
	must(t, err)
	if len(short) != 3 {
		t.Errorf("first block only: %+v", short)
	}
	for _, m := range short {
		if m.DeviceBlocks+m.HostBlocks+m.DiskBlocks+m.ExternalBlocks != 1 {
			t.Errorf("first block only: %+v", m)
		}
	}
	// Nothing matches nothing: nil, empty, or hashes no rank holds.
	for _, in := range [][]uint64{nil, {}, {0xDEAD, 0xBEEF}, hashes[1:]} {
		none, err := r.FindMatches(in)
		must(t, err)
		if none == nil || len(none) != 0 {
			t.Errorf("FindMatches(%x) = %#v, want an empty slice", in, none)
		}
	}
	// A closed router.
	r.Close()
	if _, err := r.FindMatches(hashes); err != ErrClosed {
		t.Errorf("closed router: %v", err)
	}
}

// Load changes the choice: once the prefix holder is busy, another worker wins.
func TestLoadChangesChoice(t *testing.T) {
	r := newTestRouter(t, 3)
	p := prompt(64, 1)
	must(t, r.ApplyStored(storedPrefix(1, p, 4)))
	res, err := r.FindBestMatch(p, nil)
	must(t, err)
	if res.WorkerID != 1 {
		t.Fatalf("idle: worker %d, want 1", res.WorkerID)
	}
	// Book long unrelated prompts on worker 1 (prefill tokens and blocks in flight).
	for i := 0; i < 4; i++ {
		id := "busy-" + strconv.Itoa(i)
		must(t, r.AddRequest(prompt(1024, uint32(100000*(i+1))), 1, 0, &RequestOptions{RequestID: id}))
	}
	loads, err := r.PotentialLoads(p, nil)
	must(t, err)
	for _, l := range loads {
		if l.WorkerID == 1 && (l.ActiveRequests != 4 || l.ActivePrefillTokens != 4096) {
			t.Errorf("worker 1 load %+v", l)
		}
	}
	res, err = r.FindBestMatch(p, nil)
	must(t, err)
	if res.WorkerID == 1 {
		t.Fatalf("busy worker 1 still chosen: %+v", res)
	}
	// Freeing the load brings the choice back.
	for i := 0; i < 4; i++ {
		must(t, r.FreeRequest("busy-"+strconv.Itoa(i)))
	}
	res, err = r.FindBestMatch(p, nil)
	must(t, err)
	if res.WorkerID != 1 {
		t.Fatalf("after free: worker %d, want 1", res.WorkerID)
	}
}

func TestRequestOptions(t *testing.T) {
	r := newTestRouter(t, 3)
	p := prompt(48, 1)
	must(t, r.ApplyStored(storedPrefix(2, p, 3)))
	// Restricting the candidates.
	res, err := r.FindBestMatch(p, &RequestOptions{AllowedWorkerIDs: []uint64{1, 3}})
	must(t, err)
	if res.WorkerID == 2 {
		t.Errorf("worker 2 is not allowed: %+v", res)
	}
	// Overriding the overlap credit: no credit for cached blocks.
	cands := make([]Candidate, 3)
	_, _, err = r.FindBestMatchCandidates(p, &RequestOptions{OverlapScoreCredit: Ptr(0.0)}, cands)
	must(t, err)
	for _, c := range cands {
		if c.Credit != 0 {
			t.Errorf("credit override ignored: %+v", c)
		}
	}
	// Softmax: probabilities add up to 1.
	_, n, err := r.FindBestMatchCandidates(p, &RequestOptions{Temperature: Ptr(1.0), AssumeKVReuse: Ptr(false)}, cands)
	must(t, err)
	sum := 0.0
	for _, c := range cands[:n] {
		sum += c.Probability
	}
	if math.Abs(sum-1) > 1e-9 {
		t.Errorf("probabilities sum to %v", sum)
	}
	// A namespace salts the prompt's hashes: the cached prefix no longer matches.
	res, err = r.FindBestMatch(p, &RequestOptions{CacheNamespace: "tenant"})
	must(t, err)
	if res.DeviceOverlapBlocks != 0 {
		t.Errorf("namespaced prompt matched: %+v", res)
	}
	// Multimodal hashes as well.
	res, err = r.FindBestMatch(p, &RequestOptions{MultimodalHashes: [][]uint64{{7}, nil, nil}})
	must(t, err)
	if res.DeviceOverlapBlocks != 0 {
		t.Errorf("multimodal prompt matched: %+v", res)
	}
	// Admitting books; the id can then not be reused until freed.
	res, err = r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: "a", QueueTimeout: -1})
	must(t, err)
	if !res.Booked || res.Queued {
		t.Errorf("admitted: %+v", res)
	}
}

// An empty, non-nil AllowedWorkerIDs allows no worker: every call that picks one fails with
// ErrUnavailable and books nothing, on every path that builds the options (the routing shims,
// previews, plans, the Disagg calls). nil allows every worker.
func TestEmptyAllowList(t *testing.T) {
	r := newTestRouter(t, 3)
	p := prompt(48, 1)
	none := []uint64{}
	wantNone := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, ErrUnavailable) {
			t.Errorf("%s with an empty allow-list: %v, want ErrUnavailable", what, err)
		}
	}
	res, err := r.FindBestMatch(p, &RequestOptions{AllowedWorkerIDs: none})
	wantNone("FindBestMatch (query)", err)
	res, err = r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: "a", AllowedWorkerIDs: none})
	wantNone("FindBestMatch (admit)", err)
	if res.Booked {
		t.Errorf("booked with an empty allow-list: %+v", res)
	}
	hashes, err := ComputeBlockHashes(p, bs, nil)
	must(t, err)
	_, err = r.FindBestMatch(nil, &RequestOptions{Admit: true, RequestID: "b", AllowedWorkerIDs: none,
		Prehashed: &PrehashedPrompt{LocalHashes: hashes, NumTokens: uint64(len(p))}})
	wantNone("FindBestMatch (prehashed)", err)
	_, err = r.PreviewRoute(p, &RequestOptions{AllowedWorkerIDs: none}, nil)
	wantNone("PreviewRoute", err)
	_, err = r.PlanRoute(p, &RequestOptions{RequestID: "c", AllowedWorkerIDs: none}, nil, nil)
	wantNone("PlanRoute", err)
	m, err := r.Metrics()
	must(t, err)
	if m.RequestsActive != 0 || m.Decisions != 0 {
		t.Errorf("an empty allow-list booked or decided: %+v", m)
	}

	opts := DefaultRouterOptions()
	opts.BlockSize = bs
	d, err := NewDisagg(&opts, &opts, nil)
	must(t, err)
	defer d.Close()
	must(t, d.DecodeRouter().AddWorker(WorkerConfig{WorkerID: 1}))
	_, err = d.RouteDecode(p, &RequestOptions{RequestID: "d", AllowedWorkerIDs: none}, nil, false)
	wantNone("RouteDecode", err)

	// nil: every worker.
	res, err = r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: "e", AllowedWorkerIDs: nil, Temperature: Ptr(0.0)})
	must(t, err)
	if !res.Booked {
		t.Errorf("nil allow-list: %+v", res)
	}
	_, err = r.PreviewRoute(p, &RequestOptions{}, nil)
	must(t, err)
}

func TestErrors(t *testing.T) {
	r := newTestRouter(t, 2)
	p := prompt(32, 1)
	wantCode(t, r.AddWorker(WorkerConfig{WorkerID: 1}), ErrAlreadyExists)
	wantCode(t, r.AddWorker(WorkerConfig{WorkerID: 9, BlockSize: 32}), ErrInvalidArgument)
	wantCode(t, r.UpdateWorker(WorkerConfig{WorkerID: 9}), ErrNotFound)
	wantCode(t, r.RemoveWorker(9), ErrNotFound)
	must(t, r.UpdateWorker(WorkerConfig{WorkerID: 2, DPSize: 2, TotalKVBlocks: 1000}))

	// Admission needs an id; an id can be active only once.
	_, err := r.FindBestMatch(p, &RequestOptions{Admit: true})
	wantCode(t, err, ErrInvalidArgument)
	_, err = r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: "dup"})
	must(t, err)
	_, err = r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: "dup"})
	wantCode(t, err, ErrAlreadyExists)
	wantCode(t, r.AddRequest(p, 1, 0, &RequestOptions{RequestID: "dup"}), ErrAlreadyExists)
	wantCode(t, r.AddRequest(p, 77, 0, &RequestOptions{RequestID: "x"}), ErrNotFound)
	wantCode(t, r.AddRequest(p, 1, 5, &RequestOptions{RequestID: "x"}), ErrNotFound)
	must(t, r.FreeRequest("dup"))
	must(t, r.FreeRequest("dup")) // idempotent
	must(t, r.MarkPrefillCompleted("never-seen"))

	// Bad FlatBuffers bytes: nothing applied, counted.
	wantCode(t, r.ApplyEventBatch([]byte("definitely not a flatbuffer")), ErrInvalidArgument)
	wantCode(t, r.ApplyEventBatch(nil), ErrInvalidArgument)
	wantCode(t, r.Restore([]byte{1, 2, 3, 4, 5, 6, 7, 8}), ErrInvalidArgument)
	m, err := r.Metrics()
	must(t, err)
	if m.EventBatchesRejected != 1 { // the garbage; an empty buffer is refused before verification
		t.Errorf("EventBatchesRejected = %d, want 1", m.EventBatchesRejected)
	}

	// An unknown parent is reported and counted.
	orphan := storedPrefix(1, p, 1)
	orphan.HasParent, orphan.ParentHash = true, 0xdead
	wantCode(t, r.ApplyStored(orphan), ErrNotFound)
	// An incomplete block (tokens missing) is an invalid argument.
	wantCode(t, r.ApplyStored(&StoredEvent{WorkerID: 1, BlockHashes: []uint64{1}, TokenIDs: p[:5]}), ErrInvalidArgument)
	wantCode(t, r.ApplyRemoved(&RemovedEvent{WorkerID: 1, BlockHashes: []uint64{0xbeef}}), ErrNotFound)
	wantCode(t, r.ApplyStored(&StoredEvent{WorkerID: 1, Tier: 9, BlockHashes: []uint64{1}, TokenIDs: p[:16]}), ErrInvalidArgument)
	wantCode(t, r.ApplyStored(nil), ErrInvalidArgument)
	m, err = r.Metrics()
	must(t, err)
	if m.Events[EventStored][EventParentBlockNotFound] != 1 || m.Events[EventRemoved][EventBlockNotFound] != 1 {
		t.Errorf("event outcomes %v", m.Events)
	}

	// No worker at all.
	empty := newTestRouter(t, 0)
	_, err = empty.FindBestMatch(p, nil)
	wantCode(t, err, ErrUnavailable)
}

func TestEventsAndBatches(t *testing.T) {
	r := newTestRouter(t, 2)
	p := prompt(64, 50)
	local, err := ComputeBlockHashes(p, bs, nil)
	must(t, err)

	b, err := NewEventBatch()
	must(t, err)
	defer b.Close()
	// Worker 1 by tokens, worker 2 by precomputed local hashes, in two linked events.
	must(t, b.AddStored(storedPrefix(1, p, 4)))
	must(t, b.AddStored(&StoredEvent{WorkerID: 2, BlockHashes: []uint64{21, 22}, LocalHashes: local[:2]}))
	must(t, b.AddStored(&StoredEvent{WorkerID: 2, HasParent: true, ParentHash: 22, BlockHashes: []uint64{23}, LocalHashes: local[2:3], EventID: 3}))
	if b.Len() != 3 {
		t.Fatalf("Len %d", b.Len())
	}
	wantCode(t, b.AddStored(&StoredEvent{WorkerID: 1, Tier: 7, BlockHashes: []uint64{1}, TokenIDs: p[:16]}), ErrInvalidArgument)
	wantCode(t, b.AddStored(nil), ErrInvalidArgument)
	// Encoding stamps the wall clock unless a publish time is set: fix it, so that two
	// encodings are byte for byte the same.
	must(t, b.SetPublishTime(time.Unix(1_700_000_000, 0)))
	data, err := b.Encode()
	must(t, err)
	again, err := b.AppendEncoded([]byte("prefix"))
	must(t, err)
	if string(again[:6]) != "prefix" || string(again[6:]) != string(data) {
		t.Error("AppendEncoded")
	}
	must(t, r.ApplyEventBatch(data))
	overlaps := func() map[uint64]uint32 {
		ov, err := r.OverlapScores(p, nil)
		must(t, err)
		m := map[uint64]uint32{}
		for _, o := range ov {
			m[o.WorkerID] = o.DeviceBlocks
		}
		return m
	}
	if got := overlaps(); got[1] != 4 || got[2] != 3 {
		t.Fatalf("overlaps after the batch: %v", got)
	}

	// Removal of worker 2's last block, then a clear of worker 1, in a second batch.
	b.Clear()
	if b.Len() != 0 {
		t.Fatal("Clear")
	}
	must(t, b.AddRemoved(&RemovedEvent{WorkerID: 2, BlockHashes: []uint64{23}}))
	must(t, b.AddCleared(1, 0, 9))
	data, err = b.Encode()
	must(t, err)
	must(t, r.ApplyEventBatch(data))
	if got := overlaps(); got[1] != 0 || got[2] != 2 {
		t.Fatalf("overlaps after removal and clear: %v", got)
	}
	// The single-event calls do the same.
	must(t, r.ApplyCleared(2, 0, 10))
	if got := overlaps(); len(got) != 0 {
		t.Fatalf("overlaps after clearing worker 2: %v", got)
	}
	m, err := r.Metrics()
	must(t, err)
	if m.Events[EventStored][EventOK] != 3 || m.Events[EventRemoved][EventOK] != 1 || m.Events[EventCleared][EventOK] != 2 {
		t.Errorf("event counters %v", m.Events)
	}
	// Approximate mode takes no events.
	ao := DefaultRouterOptions()
	ao.Approximate = true
	ar, err := NewRouter(&ao)
	must(t, err)
	defer ar.Close()
	wantCode(t, ar.ApplyEventBatch(data), ErrFailedPrecondition)
}

func TestSnapshotRestore(t *testing.T) {
	a := newTestRouter(t, 3)
	p := prompt(80, 7)
	must(t, a.ApplyStored(storedPrefix(1, p, 5)))
	must(t, a.ApplyStored(storedPrefix(3, p, 2)))
	snap, err := a.Snapshot()
	must(t, err)
	if len(snap) == 0 {
		t.Fatal("empty snapshot")
	}
	b := newTestRouter(t, 3)
	must(t, b.Restore(snap))
	wa, err := a.OverlapScores(p, nil)
	must(t, err)
	wb, err := b.OverlapScores(p, nil)
	must(t, err)
	if len(wa) != 2 || len(wb) != len(wa) {
		t.Fatalf("overlaps %+v vs %+v", wa, wb)
	}
	for i := range wa {
		if wa[i] != wb[i] {
			t.Errorf("restored overlap %+v, want %+v", wb[i], wa[i])
		}
	}
	res, err := b.FindBestMatch(p, nil)
	must(t, err)
	if res.WorkerID != 1 || res.DeviceOverlapBlocks != 5 {
		t.Errorf("restored routing %+v", res)
	}
	wantCode(t, b.Restore(snap), ErrFailedPrecondition) // not empty any more
	other := DefaultRouterOptions()
	other.BlockSize = 32
	c, err := NewRouter(&other)
	must(t, err)
	defer c.Close()
	wantCode(t, c.Restore(snap), ErrInvalidArgument) // another block size
}

func TestMetricsPrometheusAndGrowth(t *testing.T) {
	const workers = 40 // more ranks than the first buffer of every array call holds
	r := newTestRouter(t, workers)
	p := prompt(32, 3)
	for w := uint64(1); w <= workers; w++ {
		must(t, r.ApplyStored(storedPrefix(w, p, 1+int(w%2))))
	}
	ov, err := r.OverlapScores(p, nil)
	must(t, err)
	if len(ov) != workers {
		t.Fatalf("%d overlaps, want %d", len(ov), workers)
	}
	for _, o := range ov {
		if want := uint32(1 + o.WorkerID%2); o.DeviceBlocks != want || o.TreeSize != uint64(want) {
			t.Errorf("overlap %+v, want %d blocks", o, want)
		}
	}
	// The walk alone grows its buffer the same way (from the first buffer's 16 rows on a
	// fresh router, from none at all), and the rows it returned are remembered.
	hashes, err := ComputeBlockHashes(p, bs, nil)
	must(t, err)
	fresh := newTestRouter(t, workers)
	for w := uint64(1); w <= workers; w++ {
		must(t, fresh.ApplyStored(storedPrefix(w, p, 1+int(w%2))))
	}
	if fresh.rowsHint() != initialResults {
		t.Fatalf("fresh router's hint %d", fresh.rowsHint())
	}
	for _, capHint := range []int{initialResults, 0} {
		ms, err := fresh.findMatches(hashes, capHint)
		must(t, err)
		if len(ms) != workers {
			t.Fatalf("from %d rows: %d matches, want %d", capHint, len(ms), workers)
		}
		for _, m := range ms {
			if want := uint32(1 + m.WorkerID%2); m.DeviceBlocks != want || m.TreeSize != uint64(want) {
				t.Errorf("match %+v, want %d blocks", m, want)
			}
		}
	}
	if fresh.rowsHint() != workers {
		t.Errorf("after FindMatches the hint is %d, want %d", fresh.rowsHint(), workers)
	}
	ov0, err := r.overlapScores(p, nil, 0) // no room at all at first
	must(t, err)
	if len(ov0) != workers {
		t.Errorf("retry from 0: %d overlaps", len(ov0))
	}
	must(t, r.AddRequest(p, 5, 0, &RequestOptions{RequestID: "r"}))
	loads, err := r.potentialLoads(p, nil, 1)
	must(t, err)
	if len(loads) != workers {
		t.Fatalf("%d loads", len(loads))
	}
	for _, l := range loads {
		if (l.WorkerID == 5) != (l.ActiveRequests == 1) {
			t.Errorf("load %+v", l)
		}
		if l.PotentialPrefillTokens < l.ActivePrefillTokens {
			t.Errorf("load %+v", l)
		}
	}
	text, err := r.MetricsPrometheus()
	must(t, err)
	if len(text) <= 4096 {
		t.Logf("Prometheus text is %d bytes: the growth path was not taken", len(text))
	}
	small, err := r.metricsPrometheus(1)
	must(t, err)
	if small != text {
		t.Error("retry gave other text")
	}
	if strings.ContainsRune(text, 0) || !strings.Contains(text, "# TYPE ") || !strings.HasSuffix(text, "\n") {
		t.Errorf("not Prometheus text: %q", text[:min(len(text), 200)])
	}
	m, err := r.Metrics()
	must(t, err)
	if m.Workers != workers || m.RequestsActive != 1 || m.IndexBlocks != 60 || m.IndexBytes <= 0 || m.IndexNodes < 2 {
		t.Errorf("metrics %+v", m)
	}
}

func TestRequestLifecycle(t *testing.T) {
	r := newTestRouter(t, 2)
	p := prompt(64, 1)
	res, err := r.FindBestMatch(p, &RequestOptions{Admit: true, RequestID: "req-1"})
	must(t, err)
	if !res.Booked {
		t.Fatal("not booked")
	}
	load := func() PotentialLoad {
		loads, err := r.PotentialLoads(p, nil)
		must(t, err)
		for _, l := range loads {
			if l.WorkerID == res.WorkerID {
				return l
			}
		}
		t.Fatal("chosen worker missing")
		return PotentialLoad{}
	}
	if l := load(); l.ActiveRequests != 1 || l.ActivePrefillTokens != 64 || l.ActiveBlocks != 4 {
		t.Errorf("booked load %+v", l)
	}
	must(t, r.MarkPrefillCompleted("req-1"))
	if l := load(); l.ActiveRequests != 1 || l.ActivePrefillTokens != 0 {
		t.Errorf("after prefill %+v", l)
	}
	must(t, r.FreeRequest("req-1"))
	if l := load(); l.ActiveRequests != 0 || l.ActiveBlocks != 0 {
		t.Errorf("after free %+v", l)
	}
}

// The C struct reads num_blocks local hashes and multimodal counts: shorter Go slices are
// refused before the call instead of being read past their end.
func TestStoredEventLengths(t *testing.T) {
	r := newTestRouter(t, 1)
	p := prompt(32, 1)
	b, err := NewEventBatch()
	must(t, err)
	defer b.Close()
	short := &StoredEvent{WorkerID: 1, BlockHashes: []uint64{1, 2}, LocalHashes: []uint64{9}}
	wantCode(t, r.ApplyStored(short), ErrInvalidArgument)
	wantCode(t, b.AddStored(short), ErrInvalidArgument)
	short = &StoredEvent{WorkerID: 1, BlockHashes: []uint64{1, 2}, LocalHashes: []uint64{}}
	wantCode(t, r.ApplyStored(short), ErrInvalidArgument)
	mm := &StoredEvent{WorkerID: 1, BlockHashes: []uint64{1, 2}, TokenIDs: p, MultimodalHashes: [][]uint64{{5}}}
	wantCode(t, r.ApplyStored(mm), ErrInvalidArgument)
	// With one entry per block, multimodal blocks match only prompts with the same content.
	mm.MultimodalHashes = [][]uint64{{5}, nil}
	must(t, r.ApplyStored(mm))
	res, err := r.FindBestMatch(p, &RequestOptions{MultimodalHashes: [][]uint64{{5}}})
	must(t, err)
	if res.DeviceOverlapBlocks != 2 {
		t.Errorf("multimodal prompt: %+v", res)
	}
	res, err = r.FindBestMatch(p, nil)
	must(t, err)
	if res.DeviceOverlapBlocks != 0 {
		t.Errorf("text-only prompt matched multimodal blocks: %+v", res)
	}
}

// TestSlidingWindowEvents mirrors tests/capi/events_test.c sliding_window_stores_and_removals: a
// hybrid model's sliding-window stores and removals through StoredEvent and RemovedEvent, one by
// one and in a batch.
func TestSlidingWindowEvents(t *testing.T) {
	r := newTestRouter(t, 2)
	p := prompt(4*bs, 50)
	longer := append(append([]uint32(nil), p...), 7) // prompt + one token: 4 blocks resumable
	shorter := append([]uint32(nil), p...)           // shares the first 3 blocks only
	for i := 3 * bs; i < 4*bs; i++ {
		shorter[i] = 999
	}
	deviceBlocks := func(tokens []uint32) uint32 {
		t.Helper()
		ov, err := r.OverlapScores(tokens, nil)
		must(t, err)
		for _, o := range ov {
			if o.WorkerID == 1 {
				return o.DeviceBlocks
			}
		}
		return 0
	}
	must(t, r.ApplyStored(&StoredEvent{WorkerID: 1, BlockHashes: []uint64{100, 101, 102, 103}, TokenIDs: p}))
	// Group 0's 32-token window holds the last two blocks.
	window := StoredEvent{WorkerID: 1, BlockHashes: []uint64{102, 103}, SlidingGroup: 0, SlidingWindowTokens: 2 * bs}
	must(t, r.ApplyStored(&window))
	if got := deviceBlocks(longer); got != 4 {
		t.Fatalf("the longer prompt matches %d blocks on worker 1, want 4", got)
	}
	res, err := r.FindBestMatch(longer, nil)
	must(t, err)
	if res.WorkerID != 1 || res.DeviceOverlapBlocks != 4 {
		t.Fatalf("preview of the longer prompt: %+v", res)
	}
	// Block 2's window needs blocks 1 and 2, and the window lacks block 1: nothing resumes.
	if got := deviceBlocks(shorter); got != 0 {
		t.Fatalf("the prompt sharing 3 blocks matches %d blocks on worker 1, want 0", got)
	}

	// A block full attention does not hold cannot be placed (counted as a reject).
	wantCode(t, r.ApplyStored(&StoredEvent{WorkerID: 1, BlockHashes: []uint64{999}, SlidingWindowTokens: 2 * bs}), ErrNotFound)
	// A sliding-window store names blocks only, on the device (refused before it is applied).
	withTokens := window
	withTokens.TokenIDs = p[2*bs:]
	wantCode(t, r.ApplyStored(&withTokens), ErrInvalidArgument)
	onHost := window
	onHost.Tier = TierHostPinned
	wantCode(t, r.ApplyStored(&onHost), ErrInvalidArgument)

	// The window lets block 3 go: no hit left on worker 1; its full-attention blocks stay.
	must(t, r.ApplyRemoved(&RemovedEvent{WorkerID: 1, BlockHashes: []uint64{103}, Sliding: true, SlidingGroup: 0}))
	if got := deviceBlocks(longer); got != 0 {
		t.Fatalf("after the window's removal the longer prompt matches %d blocks, want 0", got)
	}
	m, err := r.Metrics()
	must(t, err)
	if m.IndexBlocks != 4 || m.IndexSlidingBlocks != 1 || m.SlidingEventsApplied != 2 || m.SlidingEventsRejected != 1 {
		t.Fatalf("after the removal: index %d blocks, %d sliding; sliding events %d applied, %d rejected",
			m.IndexBlocks, m.IndexSlidingBlocks, m.SlidingEventsApplied, m.SlidingEventsRejected)
	}

	// The same store through an event batch brings the hit back; a removal in a batch takes it
	// away again.
	b, err := NewEventBatch()
	must(t, err)
	defer b.Close()
	wantCode(t, b.AddStored(&withTokens), ErrInvalidArgument)
	must(t, b.AddStored(&StoredEvent{WorkerID: 1, BlockHashes: []uint64{103}, SlidingWindowTokens: 2 * bs}))
	data, err := b.Encode()
	must(t, err)
	must(t, r.ApplyEventBatch(data))
	if got := deviceBlocks(longer); got != 4 {
		t.Fatalf("after the batch's store the longer prompt matches %d blocks, want 4", got)
	}
	b.Clear()
	must(t, b.AddRemoved(&RemovedEvent{WorkerID: 1, BlockHashes: []uint64{102}, Sliding: true}))
	data, err = b.Encode()
	must(t, err)
	must(t, r.ApplyEventBatch(data))
	if got := deviceBlocks(longer); got != 0 {
		t.Fatalf("after the batch's removal the longer prompt matches %d blocks, want 0", got)
	}
	m, err = r.Metrics()
	must(t, err)
	if m.IndexBlocks != 4 || m.IndexSlidingBlocks != 1 || m.SlidingEventsApplied != 4 || m.SlidingEventsRejected != 1 {
		t.Fatalf("after the batches: index %d blocks, %d sliding; sliding events %d applied, %d rejected",
			m.IndexBlocks, m.IndexSlidingBlocks, m.SlidingEventsApplied, m.SlidingEventsRejected)
	}
}
