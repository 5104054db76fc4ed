package kvrouter

import (
	"fmt"
	"os"
	"sort"
	"strconv"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/bindings/go/internal/cbench"
)

// The binding's cost per call, as issue 16 measures it: the same calls on the same router made
// through the binding and from a loop in C, in chunks that alternate many times in one run, so
// that a noisy machine slows both alike. Per chunk the mean time per call is taken; the report
// gives the min and the 10th percentile of those means for each side and their difference (the
// overhead). Run with
//
//	KVR_OVERHEAD=1 go test -run TestOverhead -v -count=1 .
//
// (KVR_OVERHEAD_ROUNDS and KVR_OVERHEAD_CHUNK change the number of chunk pairs and the calls
// per chunk.) It asserts nothing about time: only the allocation tests do.
func TestOverhead(t *testing.T) {
	if os.Getenv("KVR_OVERHEAD") == "" {
		t.Skip("set KVR_OVERHEAD=1 to measure the binding's overhead per call")
	}
	rounds, chunk := envInt("KVR_OVERHEAD_ROUNDS", 200), envInt("KVR_OVERHEAD_CHUNK", 2000)
	r, prompts, flat, ids := overheadFleet(t)
	const qlen = 4 * bs
	ptr := unsafePtr(r)
	goChunk := map[int]func(n int){
		cbench.OpPreview: func(n int) {
			for i := 0; i < n; i++ {
				if _, err := r.FindBestMatch(prompts[i%len(prompts)], nil); err != nil {
					t.Fatal(err)
				}
			}
		},
		cbench.OpAdmitFree: func(n int) {
			opts := &RequestOptions{Admit: true}
			for i := 0; i < n; i++ {
				opts.RequestID = ids[i%len(ids)]
				if _, err := r.FindBestMatch(prompts[i%len(prompts)], opts); err != nil {
					t.Fatal(err)
				}
				if err := r.FreeRequest(opts.RequestID); err != nil {
					t.Fatal(err)
				}
			}
		},
		cbench.OpMarkFree: func(n int) {
			for i := 0; i < n; i++ {
				id := ids[i%len(ids)]
				if err := r.MarkPrefillCompleted(id); err != nil {
					t.Fatal(err)
				}
				if err := r.FreeRequest(id); err != nil {
					t.Fatal(err)
				}
			}
		},
	}
	for _, op := range []struct {
		name string
		op   int
	}{{"preview", cbench.OpPreview}, {"admit+free", cbench.OpAdmitFree}, {"mark+free", cbench.OpMarkFree}} {
		var goNs, cNs []float64
		for round := 0; round < rounds; round++ {
			start := time.Now()
			goChunk[op.op](chunk)
			goNs = append(goNs, float64(time.Since(start))/float64(chunk))
			ns, err := cbench.ChunkLoop(ptr, op.op, flat, len(prompts), qlen, ids, chunk)
			if err != nil {
				t.Fatal(err)
			}
			cNs = append(cNs, float64(ns)/float64(chunk))
		}
		gmin, gp10 := minP10(goNs)
		cmin, cp10 := minP10(cNs)
		t.Log(fmt.Sprintf("%-10s go min %7.1f p10 %7.1f | C min %7.1f p10 %7.1f | overhead min %+6.1f p10 %+6.1f ns/call",
			op.name, gmin, gp10, cmin, cp10, gmin-cmin, gp10-cp10))
	}
}

// overheadFleet is a small router (8 workers, prompts of 4 blocks, some cached) so that the
// C call is short and the binding's share of it shows.
func overheadFleet(t testing.TB) (*Router, [][]uint32, []uint32, []string) {
	r := newTestRouter(t, 8)
	const qlen = 4 * bs
	flat := make([]uint32, 0, 64*qlen)
	var prompts [][]uint32
	for q := 0; q < 64; q++ {
		p := prompt(qlen, uint32(q*1000))
		flat = append(flat, p...)
		prompts = append(prompts, flat[q*qlen:(q+1)*qlen])
		must(t, r.ApplyStored(storedPrefix(uint64(q%8+1), p, 1+q%4)))
	}
	ids := make([]string, 256)
	for i := range ids {
		ids[i] = "request-" + strconv.Itoa(i)
	}
	return r, prompts, flat, ids
}

func minP10(v []float64) (float64, float64) {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[0], s[len(s)/10]
}

func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}
