package frameworks_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/idempotency-go/idempotency"
)

func newGuard() *idempotency.Guard {
	return idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
}

var singleTenant = idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant}

// post sends a JSON POST to h at path, with the key if there is one.
func post(h http.Handler, path, key, body string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set(idempotency.HeaderKey, key)
	}
	rr := httptest.NewRecorder()
	h.ServeHTTP(rr, req)
	return rr
}

// waitCounter is a store that counts the duplicates subscribing to wait for
// their original, and closes all once there are n.
type waitCounter struct {
	idempotency.Store
	n       int64
	waiting atomic.Int64
	all     chan struct{}
}

func newWaitCounter(n int64) *waitCounter {
	return &waitCounter{Store: idempotency.NewMemoryStore(idempotency.MemoryOptions{}), n: n, all: make(chan struct{})}
}

func (s *waitCounter) Subscribe(ctx context.Context, k idempotency.Key) (idempotency.Subscription, error) {
	if s.waiting.Add(1) == s.n {
		close(s.all)
	}
	return s.Store.Subscribe(ctx, k)
}

// concurrently sends n copies of one request at once, and returns the
// answers.
func concurrently(n int, send func() *httptest.ResponseRecorder) []*httptest.ResponseRecorder {
	answers := make([]*httptest.ResponseRecorder, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { answers[i] = send() })
	}
	wg.Wait()
	return answers
}

// routes is an Observer that keeps the Route of every call's outcome.
type routes struct {
	mu   sync.Mutex
	seen []string
}

func (o *routes) Observe(_ context.Context, e idempotency.Event) {
	if e.Kind == idempotency.EventOutcome {
		o.mu.Lock()
		o.seen = append(o.seen, e.Route)
		o.mu.Unlock()
	}
}
