package kvrouter

import (
	"fmt"
	"math"
	"os"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"
)

// The plumbing between the safe layer and the C structs: abi_gen.go's mirrors (generated) and
// the conversions to and from them (hand-written). These tests go through the real C structs
// (abi_hooks.go) and compare fields by name with reflection, so a field added to the header
// and regenerated, but not carried by the safe layer, fails here by name.

// number is a field's value as a float64 (bools 0/1, pointers dereferenced); ok is false for a
// nil pointer or a kind without a number.
func number(v reflect.Value) (float64, bool) {
	if v.Kind() == reflect.Pointer {
		if v.IsNil() {
			return 0, false
		}
		v = v.Elem()
	}
	switch v.Kind() {
	case reflect.Bool:
		if v.Bool() {
			return 1, true
		}
		return 0, true
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return float64(v.Int()), true
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return float64(v.Uint()), true
	case reflect.Float32, reflect.Float64:
		return v.Float(), true
	}
	return 0, false
}

// sameValue compares two fields: numbers by value (NaN equal to NaN), arrays deeply.
func sameValue(a, b reflect.Value) bool {
	// A C char buffer (a NUL-terminated string) and its Go string.
	if a.Kind() == reflect.String && b.Kind() == reflect.Array {
		a, b = b, a
	}
	if a.Kind() == reflect.Array && b.Kind() == reflect.String {
		chars := make([]int8, a.Len())
		for i := range chars {
			chars[i] = int8(a.Index(i).Int())
		}
		return text(chars) == b.String()
	}
	if a.Kind() == reflect.Array || b.Kind() == reflect.Array {
		return reflect.DeepEqual(a.Interface(), b.Interface())
	}
	x, okx := number(a)
	y, oky := number(b)
	return okx && oky && (x == y || math.IsNaN(x) && math.IsNaN(y))
}

// differing returns the names of the fields in which two values of one struct type differ.
func differing(a, b any) []string {
	va, vb := reflect.ValueOf(a), reflect.ValueOf(b)
	var names []string
	for i := 0; i < va.NumField(); i++ {
		if !sameValue(va.Field(i), vb.Field(i)) {
			names = append(names, va.Type().Field(i).Name)
		}
	}
	return names
}

// fieldNames lists a struct type's fields.
func fieldNames(v any) []string {
	t := reflect.TypeOf(v)
	names := make([]string, t.NumField())
	for i := range names {
		names[i] = t.Field(i).Name
	}
	return names
}

// sameByName checks every field of a mirror against the public struct's field of the same
// name (a public bool stands for a mirror value != 0) and returns the mirror fields that have
// no namesake, for the caller to check.
func sameByName(t *testing.T, what string, public, mirror any) (unmatched []string) {
	t.Helper()
	pv, mv := reflect.ValueOf(public), reflect.ValueOf(mirror)
	for i := 0; i < mv.NumField(); i++ {
		name := mv.Type().Field(i).Name
		pf, mf := pv.FieldByName(name), mv.Field(i)
		if !pf.IsValid() {
			unmatched = append(unmatched, name)
			continue
		}
		ok := sameValue(pf, mf)
		if pf.Kind() == reflect.Bool {
			n, _ := number(mf)
			ok = pf.Bool() == (n != 0)
		}
		if !ok {
			t.Errorf("%s: %s is %v in the C struct, %v in Go", what, name, mf, pf)
		}
	}
	return unmatched
}

func wantNames(t *testing.T, what string, got []string, want ...string) {
	t.Helper()
	sort.Strings(got)
	sort.Strings(want)
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("%s: got fields %v, want %v", what, got, want)
	}
}

// distinct returns a mirror with every number field set to a value of its own (1, 2, ...;
// floats x.5) and every array element too.
func distinct[M any]() M {
	var m M
	v := reflect.ValueOf(&m).Elem()
	n := 0
	var fill func(f reflect.Value)
	fill = func(f reflect.Value) {
		switch f.Kind() {
		case reflect.Array:
			for i := 0; i < f.Len(); i++ {
				fill(f.Index(i))
			}
		case reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
			n++
			f.SetInt(int64(n))
		case reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
			n++
			f.SetUint(uint64(n))
		case reflect.Float32, reflect.Float64:
			n++
			f.SetFloat(float64(n) + 0.5)
		default:
			panic("distinct: field of kind " + f.Kind().String())
		}
	}
	for i := 0; i < v.NumField(); i++ {
		fill(v.Field(i))
	}
	return m
}

// setOne sets a number or bool field to a non-zero value of its own (n).
func setOne(f reflect.Value, n int) {
	switch f.Kind() {
	case reflect.Bool:
		f.SetBool(true)
	case reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		f.SetInt(int64(n))
	case reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		f.SetUint(uint64(n))
	case reflect.Float32, reflect.Float64:
		f.SetFloat(float64(n) + 0.5)
	case reflect.Array:
		for i := 0; i < f.Len(); i++ {
			setOne(f.Index(i), n+i)
		}
	default:
		panic("setOne: field of kind " + f.Kind().String())
	}
}

// eachFieldAlone converts values of S with one field set at a time (every other field zero) and
// checks the result against it by name: two fields swapped, or one field set from another
// (which values set in every field cannot tell apart, e.g. two booleans), fail here. fromC says
// that S is a mirror (a C struct read) and R the Go result; otherwise S is a Go input and R the
// mirror of the C struct it becomes.
func eachFieldAlone[S, R any](t *testing.T, what string, fromC bool, convert func(S) R) {
	t.Helper()
	typ := reflect.TypeOf(*new(S))
	for i := 0; i < typ.NumField(); i++ {
		var in S
		setOne(reflect.ValueOf(&in).Elem().Field(i), i+1)
		out := convert(in)
		name := what + " with only " + typ.Field(i).Name + " set"
		if fromC {
			sameByName(t, name, out, in)
		} else {
			sameByName(t, name, in, out)
		}
	}
}

// The generated store and load are inverses through the real C struct, for every mirror.
func TestGeneratedMirrorsStoreAndLoad(t *testing.T) {
	check := func(name string, in, out any) {
		t.Helper()
		if d := differing(in, out); len(d) > 0 {
			t.Errorf("%s: fields %v change through the C struct: %+v -> %+v", name, d, in, out)
		}
	}
	check("cHashOptions", distinct[cHashOptions](), storeLoaded(distinct[cHashOptions](), (*cHashOptions).store, (*cHashOptions).load))
	check("cRouterOptions", distinct[cRouterOptions](), storeLoaded(distinct[cRouterOptions](), (*cRouterOptions).store, (*cRouterOptions).load))
	check("cWorkerConfig", distinct[cWorkerConfig](), storeLoaded(distinct[cWorkerConfig](), (*cWorkerConfig).store, (*cWorkerConfig).load))
	check("cStoredEvent", distinct[cStoredEvent](), storeLoaded(distinct[cStoredEvent](), (*cStoredEvent).store, (*cStoredEvent).load))
	check("cRemovedEvent", distinct[cRemovedEvent](), storeLoaded(distinct[cRemovedEvent](), (*cRemovedEvent).store, (*cRemovedEvent).load))
	check("cRequestOptions", distinct[cRequestOptions](), storeLoaded(distinct[cRequestOptions](), (*cRequestOptions).store, (*cRequestOptions).load))
	check("cRouteResult", distinct[cRouteResult](), storeLoaded(distinct[cRouteResult](), (*cRouteResult).store, (*cRouteResult).load))
	check("cCandidate", distinct[cCandidate](), storeLoaded(distinct[cCandidate](), (*cCandidate).store, (*cCandidate).load))
	check("cOverlap", distinct[cOverlap](), storeLoaded(distinct[cOverlap](), (*cOverlap).store, (*cOverlap).load))
	check("cMatch", distinct[cMatch](), storeLoaded(distinct[cMatch](), (*cMatch).store, (*cMatch).load))
	check("cPotentialLoad", distinct[cPotentialLoad](), storeLoaded(distinct[cPotentialLoad](), (*cPotentialLoad).store, (*cPotentialLoad).load))
	check("cMetrics", distinct[cMetrics](), storeLoaded(distinct[cMetrics](), (*cMetrics).store, (*cMetrics).load))
	check("cRoutingHints", distinct[cRoutingHints](), storeLoaded(distinct[cRoutingHints](), (*cRoutingHints).store, (*cRoutingHints).load))
	check("cRouteSignals", distinct[cRouteSignals](), storeLoaded(distinct[cRouteSignals](), (*cRouteSignals).store, (*cRouteSignals).load))
	check("cDisaggOptions", distinct[cDisaggOptions](), storeLoaded(distinct[cDisaggOptions](), (*cDisaggOptions).store, (*cDisaggOptions).load))
	check("cPrefillResult", distinct[cPrefillResult](), storeLoaded(distinct[cPrefillResult](), (*cPrefillResult).store, (*cPrefillResult).load))
	check("cIngestOptions", distinct[cIngestOptions](), storeLoaded(distinct[cIngestOptions](), (*cIngestOptions).store, (*cIngestOptions).load))
	check("cEngineWorker", distinct[cEngineWorker](), storeLoaded(distinct[cEngineWorker](), (*cEngineWorker).store, (*cEngineWorker).load))
	check("cJetstreamSource", distinct[cJetstreamSource](), storeLoaded(distinct[cJetstreamSource](), (*cJetstreamSource).store, (*cJetstreamSource).load))
	check("cIngestStats", distinct[cIngestStats](), storeLoaded(distinct[cIngestStats](), (*cIngestStats).store, (*cIngestStats).load))
}

// Every generated init helper records the size this package was compiled with in struct_size:
// the library then reads and writes exactly the layout the package knows. The list of helpers
// is read from abi_gen.go, so a struct added to the header is checked as soon as it is
// generated (add it to initHelpers in abi_hooks.go).
func TestInitHelpersPassTheCompiledSize(t *testing.T) {
	src, err := os.ReadFile("abi_gen.go")
	must(t, err)
	generated := regexp.MustCompile(`(?m)^func init\w+\(c \*C\.(kvr_\w+)\) \{`).FindAllStringSubmatch(string(src), -1)
	if len(generated) == 0 {
		t.Fatal("no init helpers found in abi_gen.go")
	}
	helpers := initHelpers()
	for _, g := range generated {
		name := g[1]
		got, ok := helpers[name]
		if !ok {
			t.Errorf("abi_gen.go has an init helper for %s that initHelpers (abi_hooks.go) does not run", name)
			continue
		}
		if got.compiled == 0 || uintptr(got.structSize) != got.compiled {
			t.Errorf("%s: struct_size %d after init, compiled size %d", name, got.structSize, got.compiled)
		}
	}
	if len(helpers) != len(generated) {
		t.Errorf("initHelpers runs %d helpers, abi_gen.go has %d", len(helpers), len(generated))
	}
}

// DefaultRouterOptions and DefaultDisaggOptions are the library's defaults, field by field,
// and hand them back unchanged: the struct built from them is the one _init fills.
func TestDefaultsAreTheLibrarys(t *testing.T) {
	d := DefaultRouterOptions()
	if d.QueueThreshold >= 0 {
		t.Errorf("default QueueThreshold %v, want negative (never queue)", d.QueueThreshold)
	}
	want := RouterOptions{
		BlockSize: 16, QueuePolicy: QueueFCFS, OverlapScoreCredit: 1, PrefillLoadScale: 1,
		HostCacheHitWeight: 0.75, DiskCacheHitWeight: 0.25, QueueThreshold: d.QueueThreshold,
		ApproxTTL: 120 * time.Second, ApproxMaxBlocks: 1 << 20, ApproxPruneTargetRatio: 0.8,
		RequestExpiry: 300 * time.Second, IndexShards: 1, CostFunction: CostCredit, TTFTMissWeight: 3,
	}
	if diff := differing(d, want); len(diff) > 0 {
		t.Errorf("DefaultRouterOptions differs from the header's defaults in %v: %+v", diff, d)
	}
	defaults := initLoaded(initRouterOptions, (*cRouterOptions).load)
	if diff := differing(loaded(d.toC(), (*cRouterOptions).load), defaults); len(diff) > 0 {
		t.Errorf("DefaultRouterOptions passed to C differs from kvr_router_options_init in %v", diff)
	}

	dd := DefaultDisaggOptions()
	if dd.DecodeBusyThreshold >= 0 {
		t.Errorf("default DecodeBusyThreshold %v, want negative (no signal)", dd.DecodeBusyThreshold)
	}
	wantDisagg := DisaggOptions{Policy: DisaggAlways, MaxLocalPrefillTokens: 512, MaxLocalPrefillRatio: 1,
		PrefillBusyThreshold: 1, DecodeBusyThreshold: dd.DecodeBusyThreshold}
	if diff := differing(dd, wantDisagg); len(diff) > 0 {
		t.Errorf("DefaultDisaggOptions differs from the header's defaults in %v: %+v", diff, dd)
	}
	if diff := differing(loaded(dd.toC(), (*cDisaggOptions).load),
		initLoaded(initDisaggOptions, (*cDisaggOptions).load)); len(diff) > 0 {
		t.Errorf("DefaultDisaggOptions passed to C differs from kvr_disagg_options_init in %v", diff)
	}

	// The zero values of the other inputs mean "every default" (per-request: the router's).
	var a args
	defer a.release()
	zero := []struct {
		name      string
		sent, lib any
	}{
		{"RequestOptions", loaded((&RequestOptions{}).toC(&a), (*cRequestOptions).load), initLoaded(initRequestOptions, (*cRequestOptions).load)},
		{"RoutingHints", loaded((&RoutingHints{}).toC(&a), (*cRoutingHints).load), initLoaded(initRoutingHints, (*cRoutingHints).load)},
		{"WorkerConfig", loaded((&WorkerConfig{}).toC(), (*cWorkerConfig).load), initLoaded(initWorkerConfig, (*cWorkerConfig).load)},
		{"IngestOptions", loaded((&IngestOptions{}).toC(), (*cIngestOptions).load), initLoaded(initIngestOptions, (*cIngestOptions).load)},
		{"EngineWorker", loaded((&EngineWorker{}).toC(&a), (*cEngineWorker).load), initLoaded(initEngineWorker, (*cEngineWorker).load)},
		{"JetStreamSource", loaded((&JetStreamSource{}).toC(&a), (*cJetstreamSource).load), initLoaded(initJetstreamSource, (*cJetstreamSource).load)},
		{"HashOptions", loaded((&HashOptions{}).toC(&a), (*cHashOptions).load), initLoaded(initHashOptions, (*cHashOptions).load)},
	}
	for _, z := range zero {
		if diff := differing(z.sent, z.lib); len(diff) > 0 {
			t.Errorf("zero %s differs from the library's defaults in %v: %+v, want %+v", z.name, diff, z.sent, z.lib)
		}
	}
	// The request defaults, as the header states them.
	rd := initLoaded(initRequestOptions, (*cRequestOptions).load)
	for _, f := range []float64{rd.OverlapScoreCredit, rd.PrefillLoadScale, rd.HostCacheHitWeight,
		rd.DiskCacheHitWeight, rd.Temperature, rd.OverlapScoreCreditDecay, rd.DecodeActiveRequestWeight, rd.TTFTMissWeight} {
		if !math.IsNaN(f) {
			t.Errorf("request option defaults: an override is %v, want NaN: %+v", f, rd)
		}
	}
	if rd.AssumeKVReuse != -1 || rd.TrackPrefillTokens != -1 || rd.QueueTimeoutMs != -1 || rd.CostFunction != -1 {
		t.Errorf("request option defaults: %+v", rd)
	}
}

// Every option set through the safe layer reaches the C struct, in its own field: each input
// type, with every field set to something other than its default, is passed to C the way the
// calls pass it, read back with the generated load, and compared field by field.
func TestEveryOptionReachesTheCStruct(t *testing.T) {
	var a args
	defer a.release()

	ro := RouterOptions{
		BlockSize: 32, Approximate: true, NoKVReuse: true, NoPrefillTracking: true, Eagle: true,
		EntropySeed: true, TrackOutputBlocks: true, QueuePolicy: QueueWSPT,
		OverlapScoreCredit: 0.5, PrefillLoadScale: 2, HostCacheHitWeight: 0.5, DiskCacheHitWeight: 0.125,
		Temperature: 0.25, QueueThreshold: 3, ApproxTTL: 7 * time.Second, ApproxMaxBlocks: 4096,
		ApproxPruneTargetRatio: 0.5, RequestExpiry: 90 * time.Second, RandomSeed: 99,
		OverlapScoreCreditDecay: 0.75, DecodeActiveRequestWeight: 1.5, IndexShards: 4,
		CostFunction: CostPredictedTTFT, PrefillTokensPerSecond: 5000, TTFTMissWeight: 0.5,
	}
	if diff := differing(ro, DefaultRouterOptions()); len(diff) != len(fieldNames(ro)) {
		t.Fatalf("the test's RouterOptions must differ from the defaults in every field; same in %v",
			strings.Join(missing(fieldNames(ro), diff), ", "))
	}
	sent := loaded(ro.toC(), (*cRouterOptions).load)
	checkAllSet(t, "RouterOptions", sent, initLoaded(initRouterOptions, (*cRouterOptions).load))
	wantNames(t, "RouterOptions fields without a Go namesake", sameByName(t, "RouterOptions", ro, sent),
		"Flags", "ApproxTTLSeconds", "RequestExpirySeconds")
	if sent.Flags != 0x3f || sent.ApproxTTLSeconds != 7 || sent.RequestExpirySeconds != 90 {
		t.Errorf("RouterOptions: flags %#x, TTL %v s, expiry %v s", sent.Flags, sent.ApproxTTLSeconds, sent.RequestExpirySeconds)
	}
	if back := routerOptionsFrom(&sent); back != ro {
		t.Errorf("RouterOptions through C: %+v, want %+v", back, ro)
	}
	// Each flag alone, so that no two booleans share a bit.
	for i, set := range []func(*RouterOptions){
		func(o *RouterOptions) { o.Approximate = true },
		func(o *RouterOptions) { o.NoKVReuse = true },
		func(o *RouterOptions) { o.NoPrefillTracking = true },
		func(o *RouterOptions) { o.Eagle = true },
		func(o *RouterOptions) { o.EntropySeed = true },
		func(o *RouterOptions) { o.TrackOutputBlocks = true },
	} {
		var o RouterOptions
		set(&o)
		if m := o.mirror(); m.Flags != 1<<i {
			t.Errorf("RouterOptions flag %d: %#x", i, m.Flags)
		} else if back := routerOptionsFrom(&m); back != o {
			t.Errorf("RouterOptions flag %d back: %+v", i, back)
		}
	}

	do := DisaggOptions{Policy: DisaggISLOrLoad, Enforce: true, MaxLocalPrefillTokens: 100,
		MaxLocalPrefillRatio: 0.5, PrefillBusyThreshold: 2, DecodeBusyThreshold: 0.9}
	dsent := loaded(do.toC(), (*cDisaggOptions).load)
	checkAllSet(t, "DisaggOptions", dsent, initLoaded(initDisaggOptions, (*cDisaggOptions).load))
	wantNames(t, "DisaggOptions fields without a Go namesake", sameByName(t, "DisaggOptions", do, dsent))
	if back := disaggOptionsFrom(&dsent); back != do {
		t.Errorf("DisaggOptions through C: %+v, want %+v", back, do)
	}

	rq := RequestOptions{
		Admit: true, RequestID: "r", LoraName: "l", CacheNamespace: "n",
		MultimodalHashes: [][]uint64{{1}, {2, 3}}, AllowedWorkerIDs: []uint64{1, 2, 3},
		OverlapScoreCredit: Ptr(0.5), PrefillLoadScale: Ptr(2.0), HostCacheHitWeight: Ptr(0.25),
		DiskCacheHitWeight: Ptr(0.125), Temperature: Ptr(0.75), AssumeKVReuse: Ptr(false),
		TrackPrefillTokens: Ptr(true), OverlapScoreCreditDecay: Ptr(1.25), DecodeActiveRequestWeight: Ptr(1.75),
		CostFunction: Ptr(CostPredictedTTFT), TTFTMissWeight: Ptr(3.5),
		PriorityJump: 2.5, ExpectedOutputTokens: 77, QueueTimeout: 1500 * time.Microsecond,
		Prehashed: &PrehashedPrompt{LocalHashes: []uint64{4, 5}, NumTokens: 40},
	}
	rsent := loaded(rq.toC(&a), (*cRequestOptions).load)
	checkAllSet(t, "RequestOptions", rsent, initLoaded(initRequestOptions, (*cRequestOptions).load))
	wantNames(t, "RequestOptions fields without a Go namesake", sameByName(t, "RequestOptions", rq, rsent),
		"Flags", "MmNumBlocks", "NumAllowedWorkerIDs", "QueueTimeoutMs", "NumLocalHashes")
	if rsent.Flags != 3 || rsent.MmNumBlocks != 2 || rsent.NumAllowedWorkerIDs != 3 || rsent.QueueTimeoutMs != 2 ||
		rsent.NumLocalHashes != 2 {
		t.Errorf("RequestOptions: %+v", rsent)
	}
	if m := loaded((&RequestOptions{QueueTimeout: -time.Second}).toC(&a), (*cRequestOptions).load); m.QueueTimeoutMs != 0 {
		t.Errorf("a negative QueueTimeout gives up at once (0 ms), got %d", m.QueueTimeoutMs)
	}

	hints := RoutingHints{Phase: PhaseDecode, WorkerID: Ptr[uint64](5), PrefillWorkerID: Ptr[uint64](6),
		DecodeWorkerID: Ptr[uint64](7), DPRank: Ptr[uint32](1), PrefillDPRank: Ptr[uint32](2),
		SessionID: "s", SessionMode: SessionSoft, SessionTTL: 42 * time.Second}
	hsent := loaded(hints.toC(&a), (*cRoutingHints).load)
	checkAllSet(t, "RoutingHints", hsent, initLoaded(initRoutingHints, (*cRoutingHints).load))
	wantNames(t, "RoutingHints fields without a Go namesake", sameByName(t, "RoutingHints", hints, hsent),
		"SessionTTLSeconds")
	if hsent.SessionTTLSeconds != 42 {
		t.Errorf("RoutingHints: %+v", hsent)
	}

	wc := WorkerConfig{WorkerID: 3, BlockSize: 32, DPStart: 2, DPSize: 4, TotalKVBlocks: 1000, MaxNumBatchedTokens: 8192}
	wsent := loaded(wc.toC(), (*cWorkerConfig).load)
	checkAllSet(t, "WorkerConfig", wsent, initLoaded(initWorkerConfig, (*cWorkerConfig).load))
	wantNames(t, "WorkerConfig fields without a Go namesake", sameByName(t, "WorkerConfig", wc, wsent))

	io := IngestOptions{MaxFrameBytes: 1 << 20, ReplayTimeout: 1500 * time.Millisecond,
		ReplicaHeartbeat: 250 * time.Millisecond, ReplicaTimeout: 2500*time.Millisecond + 1}
	isent := loaded(io.toC(), (*cIngestOptions).load)
	checkAllSet(t, "IngestOptions", isent, initLoaded(initIngestOptions, (*cIngestOptions).load))
	wantNames(t, "IngestOptions fields without a Go namesake", sameByName(t, "IngestOptions", io, isent),
		"ReplayTimeoutMs", "ReplicaHeartbeatMs", "ReplicaTimeoutMs")
	if isent.ReplayTimeoutMs != 1500 || isent.ReplicaHeartbeatMs != 250 || isent.ReplicaTimeoutMs != 2501 {
		t.Errorf("IngestOptions: %+v", isent)
	}
	// 0 keeps the library's default, a negative duration turns liveness off (0 in C), and a
	// duration too long for a uint32 of milliseconds stays out of range.
	idef := initLoaded(initIngestOptions, (*cIngestOptions).load)
	if m := loaded((&IngestOptions{}).toC(), (*cIngestOptions).load); m != idef {
		t.Errorf("IngestOptions{} gives %+v, the library's defaults are %+v", m, idef)
	}
	if m := loaded((&IngestOptions{ReplicaHeartbeat: -1, ReplicaTimeout: -time.Second}).toC(), (*cIngestOptions).load); m.ReplicaHeartbeatMs != 0 || m.ReplicaTimeoutMs != 0 {
		t.Errorf("negative replica durations: %+v", m)
	}
	if m := loaded((&IngestOptions{ReplicaTimeout: 50 * 24 * time.Hour}).toC(), (*cIngestOptions).load); m.ReplicaTimeoutMs != math.MaxUint32 {
		t.Errorf("a 50-day replica timeout: %+v", m)
	}

	ew := EngineWorker{Engine: EngineSGLang, Endpoint: "tcp://127.0.0.1:1", WorkerID: 4, DPStart: 1, DPSize: 2,
		BlockSize: 32, Eagle: true, Topic: "t", ReplayEndpoint: "tcp://127.0.0.1:2"}
	esent := loaded(ew.toC(&a), (*cEngineWorker).load)
	checkAllSet(t, "EngineWorker", esent, initLoaded(initEngineWorker, (*cEngineWorker).load))
	wantNames(t, "EngineWorker fields without a Go namesake", sameByName(t, "EngineWorker", ew, esent), "Flags")
	if esent.Flags != 2 { // KVR_STORED_EAGLE
		t.Errorf("EngineWorker: %+v", esent)
	}

	js := JetStreamSource{URL: "nats://127.0.0.1:1", Stream: "KV", Subject: "kv.>", Durable: "gw-1",
		StartSequence: 7, Resume: true, CreateStream: true, MaxAge: 90 * time.Second, MaxBytes: 1 << 20}
	jsent := loaded(js.toC(&a), (*cJetstreamSource).load)
	checkAllSet(t, "JetStreamSource", jsent, initLoaded(initJetstreamSource, (*cJetstreamSource).load))
	wantNames(t, "JetStreamSource fields without a Go namesake", sameByName(t, "JetStreamSource", js, jsent),
		"Flags", "MaxAgeSeconds")
	if jsent.Flags != 3 || jsent.MaxAgeSeconds != 90 { // KVR_JETSTREAM_RESUME | _CREATE_STREAM
		t.Errorf("JetStreamSource: %+v", jsent)
	}
	// Each flag alone, and negative limits: no limit (0 s, -1 bytes).
	if m := loaded((&JetStreamSource{CreateStream: true}).toC(&a), (*cJetstreamSource).load); m.Flags != 2 {
		t.Errorf("CreateStream alone: flags %#x, want KVR_JETSTREAM_CREATE_STREAM", m.Flags)
	}
	if m := loaded((&JetStreamSource{Resume: true}).toC(&a), (*cJetstreamSource).load); m.Flags != 1 {
		t.Errorf("Resume alone: flags %#x, want KVR_JETSTREAM_RESUME", m.Flags)
	}
	if m := loaded((&JetStreamSource{MaxAge: -1, MaxBytes: -5}).toC(&a), (*cJetstreamSource).load); m.MaxAgeSeconds != 0 || m.MaxBytes != -1 {
		t.Errorf("negative limits: %+v, want 0 s and -1 bytes (no limit)", m)
	}
	if d := initLoaded(initJetstreamSource, (*cJetstreamSource).load); d.MaxAgeSeconds != 3600 || d.MaxBytes != 1<<30 || d.Flags != 0 || d.StartSequence != 0 {
		t.Errorf("kvr_jetstream_source_init's defaults: %+v, want 3600 s, 1 GiB", d)
	}

	se := StoredEvent{WorkerID: 1, DPRank: 2, EventID: 3, Tier: TierDisk, HasParent: true, ParentHash: 4,
		Eagle: true, BlockHashes: []uint64{5, 6}, TokenIDs: make([]uint32, 33), LoraName: "l", CacheNamespace: "n",
		SlidingGroup: 7, SlidingWindowTokens: 8} // the library would refuse the mix; lowering does not judge it
	ce, err := se.toC(&a)
	must(t, err)
	ssent := loaded(ce, (*cStoredEvent).load)
	checkAllSet(t, "StoredEvent", ssent, initLoaded(initStoredEvent, (*cStoredEvent).load))
	wantNames(t, "StoredEvent fields without a Go namesake", sameByName(t, "StoredEvent", se, ssent),
		"Flags", "NumBlocks", "NumTokens")
	if ssent.Flags != 3 || ssent.NumBlocks != 2 || ssent.NumTokens != 33 {
		t.Errorf("StoredEvent: %+v", ssent)
	}

	re := RemovedEvent{WorkerID: 1, DPRank: 2, EventID: 3, Tier: TierExternal, BlockHashes: []uint64{5},
		Sliding: true, SlidingGroup: 4}
	rmsent := loaded(re.toC(&a), (*cRemovedEvent).load)
	checkAllSet(t, "RemovedEvent", rmsent, initLoaded(initRemovedEvent, (*cRemovedEvent).load))
	wantNames(t, "RemovedEvent fields without a Go namesake", sameByName(t, "RemovedEvent", re, rmsent),
		"Flags", "NumBlocks")
	if rmsent.Flags != 1 || rmsent.NumBlocks != 1 { // KVR_REMOVED_SLIDING
		t.Errorf("RemovedEvent: %+v", rmsent)
	}

	ho := HashOptions{Eagle: true, LoraName: "l", MultimodalHashes: [][]uint64{{1}}}
	hosent := loaded(ho.toC(&a), (*cHashOptions).load)
	checkAllSet(t, "HashOptions", hosent, initLoaded(initHashOptions, (*cHashOptions).load))
	if hosent.Flags != 1 || hosent.MmNumBlocks != 1 {
		t.Errorf("HashOptions: %+v", hosent)
	}

	// One field at a time, for the inputs without "0 = default" fields.
	eachFieldAlone(t, "RouterOptions", false, func(o RouterOptions) cRouterOptions { return loaded(o.toC(), (*cRouterOptions).load) })
	eachFieldAlone(t, "DisaggOptions", false, func(o DisaggOptions) cDisaggOptions { return loaded(o.toC(), (*cDisaggOptions).load) })
	eachFieldAlone(t, "RouteSignals", false, func(s RouteSignals) cRouteSignals { return loaded(s.toC(), (*cRouteSignals).load) })

	sig := RouteSignals{WorkerID: 1, DPRank: 2, OverlapBlocks: 3, PromptBlocks: 4, CachedTokens: 5,
		PotentialDecodeBlocks: 6, TotalKVBlocks: 7, Cost: 8.5, PromptTokens: 9, Booked: true, Moved: true, Queued: true}
	sigsent := loaded(sig.toC(), (*cRouteSignals).load)
	checkAllSet(t, "RouteSignals", sigsent, initLoaded(initRouteSignals, (*cRouteSignals).load))
	wantNames(t, "RouteSignals fields without a Go namesake", sameByName(t, "RouteSignals", sig, sigsent))
	if back := signalsFrom(&sigsent); back != sig {
		t.Errorf("RouteSignals through C: %+v, want %+v", back, sig)
	}
}

// checkAllSet fails for each field of the C struct that still holds its default.
func checkAllSet(t *testing.T, what string, sent, defaults any) {
	t.Helper()
	if same := missing(fieldNames(sent), differing(sent, defaults)); len(same) > 0 {
		t.Errorf("%s: the C struct's %v kept the defaults (a field the safe layer does not set?)", what, same)
	}
}

// missing returns the names of all that are not in some.
func missing(all, some []string) []string {
	in := map[string]bool{}
	for _, s := range some {
		in[s] = true
	}
	var out []string
	for _, a := range all {
		if !in[a] {
			out = append(out, a)
		}
	}
	return out
}

// Every result field the library writes reaches the Go result, in its own field.
func TestEveryResultFieldReachesGo(t *testing.T) {
	rr := distinct[cRouteResult]()
	wantNames(t, "RouteResult", sameByName(t, "RouteResult", routeResultFrom(&rr), rr))
	cand := distinct[cCandidate]()
	wantNames(t, "Candidate", sameByName(t, "Candidate", candidateFrom(&cand), cand))
	ov := distinct[cOverlap]()
	wantNames(t, "Overlap", sameByName(t, "Overlap", Overlap(ov), ov))
	ma := distinct[cMatch]()
	wantNames(t, "Match", sameByName(t, "Match", Match(ma), ma))
	pl := distinct[cPotentialLoad]()
	wantNames(t, "PotentialLoad", sameByName(t, "PotentialLoad", PotentialLoad(pl), pl))
	sig := distinct[cRouteSignals]()
	wantNames(t, "RouteSignals", sameByName(t, "RouteSignals", signalsFrom(&sig), sig))
	pr := distinct[cPrefillResult]()
	wantNames(t, "PrefillResult", sameByName(t, "PrefillResult", prefillResultFrom(&pr), pr))
	me := distinct[cMetrics]()
	mf := metricsFrom(&me)
	wantNames(t, "Metrics", sameByName(t, "Metrics", mf, me),
		"DecisionLatencyBoundsNs", "DecisionLatencyLe", "DecisionLatencyCount", "DecisionLatencySumNs")
	for i := range me.DecisionLatencyBoundsNs {
		if mf.DecisionLatency.Bounds[i] != time.Duration(me.DecisionLatencyBoundsNs[i]) || mf.DecisionLatency.Counts[i] != me.DecisionLatencyLe[i] {
			t.Errorf("Metrics.DecisionLatency bucket %d: %+v from %+v", i, mf.DecisionLatency, me)
		}
	}
	if mf.DecisionLatency.Count != me.DecisionLatencyCount || mf.DecisionLatency.Sum != time.Duration(me.DecisionLatencySumNs) {
		t.Errorf("Metrics.DecisionLatency: %+v from %+v", mf.DecisionLatency, me)
	}
	is := distinct[cIngestStats]()
	st := ingestStatsFrom(&is)
	wantNames(t, "IngestStats", sameByName(t, "IngestStats", st, is), "LagTotalUs", "LagMaxUs", "LagLastUs")
	if st.LagTotal != micros(is.LagTotalUs) || st.LagMax != micros(is.LagMaxUs) || st.LagLast != micros(is.LagLastUs) {
		t.Errorf("IngestStats lags: %+v from %+v", st, is)
	}
	// One field at a time.
	eachFieldAlone(t, "RouteResult", true, func(m cRouteResult) RouteResult { return routeResultFrom(&m) })
	eachFieldAlone(t, "Candidate", true, func(m cCandidate) Candidate { return candidateFrom(&m) })
	eachFieldAlone(t, "RouteSignals", true, func(m cRouteSignals) RouteSignals { return signalsFrom(&m) })
	eachFieldAlone(t, "PrefillResult", true, func(m cPrefillResult) PrefillResult { return prefillResultFrom(&m) })
	eachFieldAlone(t, "Metrics", true, func(m cMetrics) Metrics { return metricsFrom(&m) })
	eachFieldAlone(t, "IngestStats", true, func(m cIngestStats) IngestStats { return ingestStatsFrom(&m) })
	// And a zero struct is a zero result (no field set from anything else).
	for name, got := range map[string]any{
		"RouteResult": routeResultFrom(&cRouteResult{}), "Candidate": candidateFrom(&cCandidate{}),
		"RouteSignals": signalsFrom(&cRouteSignals{}), "PrefillResult": prefillResultFrom(&cPrefillResult{}),
		"Metrics": metricsFrom(&cMetrics{}), "IngestStats": ingestStatsFrom(&cIngestStats{}),
	} {
		if !reflect.ValueOf(got).IsZero() {
			t.Errorf("%s from a zero C struct: %+v", name, got)
		}
	}
}

// The router-wide cost settings set through RouterOptions are the ones the router prices
// with: every term of the candidates' costs follows them.
func TestRouterOptionsReachTheRouter(t *testing.T) {
	const block = 32
	opts := DefaultRouterOptions()
	opts.BlockSize = block
	opts.OverlapScoreCredit = 0.5
	opts.PrefillLoadScale = 2
	opts.HostCacheHitWeight = 0.375
	opts.DiskCacheHitWeight = 0.125
	opts.Temperature = 0.5
	opts.OverlapScoreCreditDecay = 1
	opts.DecodeActiveRequestWeight = 1.5
	opts.RandomSeed = 3
	r, err := NewRouter(&opts)
	must(t, err)
	t.Cleanup(func() { r.Close() })
	for id := uint64(1); id <= 4; id++ {
		must(t, r.AddWorker(WorkerConfig{WorkerID: id}))
	}
	p := prompt(8*block, 1)
	ev := func(worker uint64, tier Tier, blocks int) *StoredEvent {
		hashes := make([]uint64, blocks)
		for i := range hashes {
			hashes[i] = worker<<32 | uint64(i+1)
		}
		return &StoredEvent{WorkerID: worker, Tier: tier, BlockHashes: hashes, TokenIDs: p[:blocks*block]}
	}
	must(t, r.ApplyStored(ev(1, TierDevice, 4)))
	must(t, r.ApplyStored(ev(2, TierHostPinned, 2)))
	must(t, r.ApplyStored(ev(3, TierDisk, 4)))
	// A two-block prefill in flight on worker 1: a backlog for the decay, a request for the weight.
	must(t, r.AddRequest(prompt(2*block, 90000), 1, 0, &RequestOptions{RequestID: "backlog"}))

	res, got := candidatesByWorker(t, r, p, nil)
	if res.PromptBlocks != 8 || res.PromptTokens != 8*block {
		t.Errorf("block size %d not applied: %+v", block, res)
	}
	decay := 1 / (1 + 1*2.0/8)
	wantCredit := map[uint64]float64{1: 0.5 * decay * 4, 2: 0.375 * 2, 3: 0.125 * 4, 4: 0}
	sum := 0.0
	positive := 0
	for id, c := range got {
		if math.Abs(c.Credit-wantCredit[id]) > 1e-9 {
			t.Errorf("worker %d credit %v, want %v: %+v", id, c.Credit, wantCredit[id], c)
		}
		if want := 2 * math.Max(0, c.RawPrefillBlocks-c.Credit); math.Abs(c.PrefillCost-want) > 1e-9 {
			t.Errorf("worker %d prefill cost %v, want 2 × max(0, %v − %v)", id, c.PrefillCost, c.RawPrefillBlocks, c.Credit)
		}
		if want := 1.5 * float64(c.ActiveRequests); c.RequestCost != want {
			t.Errorf("worker %d request cost %v, want %v", id, c.RequestCost, want)
		}
		if want := c.PrefillCost + float64(c.DecodeBlocks) + c.RequestCost; math.Abs(c.Cost-want) > 1e-9 {
			t.Errorf("worker %d cost %v, want %v", id, c.Cost, want)
		}
		sum += c.Probability
		if c.Probability > 0 {
			positive++
		}
	}
	if c := got[1]; c.ActiveRequests != 1 || math.Abs(c.CreditDecay-decay) > 1e-9 {
		t.Errorf("worker 1: %+v, want one request and credit decay %v", c, decay)
	}
	if math.Abs(sum-1) > 1e-9 || positive < 2 {
		t.Errorf("temperature 0.5: probabilities sum to %v, %d positive", sum, positive)
	}

	// The flags: approximate mode takes no events, and no prefill tracking counts no prefill.
	flags := DefaultRouterOptions()
	flags.Approximate = true
	flags.NoPrefillTracking = true
	flags.TrackOutputBlocks = true
	fr, err := NewRouter(&flags)
	must(t, err)
	t.Cleanup(func() { fr.Close() })
	must(t, fr.AddWorker(WorkerConfig{WorkerID: 1}))
	wantCode(t, fr.ApplyStored(storedPrefix(1, p, 1)), ErrFailedPrecondition)
	must(t, fr.AddRequest(p, 1, 0, &RequestOptions{RequestID: "a"}))
	must(t, fr.RecordOutput("a", 1))
	loads, err := fr.PotentialLoads(p, nil)
	must(t, err)
	if len(loads) != 1 || loads[0].ActivePrefillTokens != 0 || loads[0].ActiveRequests != 1 {
		t.Errorf("no prefill tracking: %+v", loads)
	}
}

// A library of another major.minor than this package's ABI is refused: CheckVersion and every
// constructor return ErrFailedPrecondition naming both versions, without calling into it.
func TestVersionCheck(t *testing.T) {
	r := newTestRouter(t, 1) // made while the real library is accepted
	t.Cleanup(func() { setLibraryVersion(Version(), VersionString()) })
	type version struct {
		number uint32
		text   string
		ok     bool
	}
	at := func(major, minor, patch int, ok bool) version {
		return version{uint32(major*10000 + minor*100 + patch), fmt.Sprintf("%d.%d.%d", major, minor, patch), ok}
	}
	major, minor := int(abiVersionMajor), int(abiVersionMinor)
	versions := []version{
		at(major, minor, 7, true), // a newer patch release
		at(major, minor+1, 0, false),
		at(major+1, minor, 0, false),
	}
	if minor > 0 {
		versions = append(versions, at(major, minor-1, 9, false))
	}
	accepts := fmt.Sprintf("%d.%d.x", major, minor)
	for _, v := range versions {
		setLibraryVersion(v.number, v.text)
		err := CheckVersion()
		if v.ok {
			must(t, err)
			continue
		}
		wantCode(t, err, ErrFailedPrecondition)
		if msg := err.Error(); !strings.Contains(msg, v.text) || !strings.Contains(msg, accepts) {
			t.Errorf("%s: the message names both versions: %q", v.text, msg)
		}
		refused := func(what string, err error) {
			t.Helper()
			if err != CheckVersion() {
				t.Errorf("%s with library %s: %v, want the version error", what, v.text, err)
			}
		}
		_, err = NewRouter(nil)
		refused("NewRouter", err)
		_, err = NewDisagg(nil, nil, nil)
		refused("NewDisagg", err)
		_, err = NewIngest(r, nil)
		refused("NewIngest", err)
		_, err = NewEventBatch()
		refused("NewEventBatch", err)
		_, err = ConnectPublisher("unix:///nonexistent/kvrouter.sock") // would be ErrUnavailable
		refused("ConnectPublisher", err)
		_, err = ComputeBlockHashes(prompt(32, 1), bs, nil)
		refused("ComputeBlockHashes", err)
		_, err = ComputeSequenceHashes([]uint64{1, 2})
		refused("ComputeSequenceHashes", err)
		if o := DefaultRouterOptions(); o != (RouterOptions{}) {
			t.Errorf("DefaultRouterOptions with library %s: %+v, want the zero value", v.text, o)
		}
		if o := DefaultDisaggOptions(); o != (DisaggOptions{}) {
			t.Errorf("DefaultDisaggOptions with library %s: %+v", v.text, o)
		}
		if tier := TierFromMedium("DISK"); tier != TierDevice {
			t.Errorf("TierFromMedium with library %s: %v", v.text, tier)
		}
	}
	setLibraryVersion(Version(), VersionString())
	must(t, CheckVersion())
	// The refused NewIngest left nothing open on the router.
	must(t, r.Close())
}
