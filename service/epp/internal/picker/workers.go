package picker

import (
	"context"
	"sync"
	"time"
)

// addressBook maps worker addresses to worker ids, from kvrouterd's GET /v1/workers. The list
// is kept for a short time: a subset hint comes with every request, and asking kvrouterd for
// the whole list each time would double the calls per request.
type addressBook struct {
	client *Client
	ttl    time.Duration
	now    func() time.Time

	mu      sync.Mutex
	fetched time.Time
	ids     map[string]uint64 // address -> worker id
}

func newAddressBook(client *Client, ttl time.Duration) *addressBook {
	return &addressBook{client: client, ttl: ttl, now: time.Now}
}

// workerIDs returns the ids of the workers at the given addresses, in the order given,
// skipping addresses no worker has.
func (b *addressBook) workerIDs(ctx context.Context, addresses []string) ([]uint64, error) {
	ids, err := b.current(ctx)
	if err != nil {
		return nil, err
	}
	var out []uint64
	for _, address := range addresses {
		if id, ok := ids[address]; ok {
			out = append(out, id)
		}
	}
	return out, nil
}

// current returns the map, fetched again when older than the ttl. The lock is held across the
// fetch so that concurrent streams make one call, not one each.
func (b *addressBook) current(ctx context.Context) (map[string]uint64, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ids != nil && b.now().Sub(b.fetched) < b.ttl {
		return b.ids, nil
	}
	workers, err := b.client.Workers(ctx)
	if err != nil {
		return nil, err
	}
	ids := make(map[string]uint64, len(workers))
	for _, w := range workers {
		if w.Address != "" {
			ids[w.Address] = w.WorkerID
		}
	}
	b.ids, b.fetched = ids, b.now()
	return ids, nil
}
