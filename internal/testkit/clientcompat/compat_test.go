package clientcompat_test

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
)

// ledger is the service's handler and the payment provider behind it. Each
// run of the handler is one execution, counted by Idempotency-Key. It
// charges through a provider that, like a real one, makes at most one charge
// per downstream key (the operation's DownstreamKey, the same for every
// attempt at it) and a new one for every run that has none, as a request the
// middleware let through unguarded has none.
type ledger struct {
	// afterCharge, when set, runs in each execution after the charge and
	// before the answer: there a test stalls an owner or loses its store.
	afterCharge func(r *http.Request)

	mu      sync.Mutex
	runs    map[string]int // executions per Idempotency-Key, "" for none
	charged map[string]int // downstream key → its charge's number
	charges int
}

func newLedger() *ledger {
	return &ledger{runs: map[string]int{}, charged: map[string]int{}}
}

// charge counts an execution of r and returns the number of its charge,
// from 1.
func (l *ledger) charge(r *http.Request) int {
	dk, _ := idempotency.DownstreamKey(r.Context(), "gateway") // "" for a request without a key
	l.mu.Lock()
	n, ok := l.charged[dk]
	if !ok || dk == "" {
		l.charges++
		n = l.charges
		if dk != "" {
			l.charged[dk] = n
		}
	}
	l.runs[r.Header.Get("Idempotency-Key")]++
	l.mu.Unlock()
	if l.afterCharge != nil {
		l.afterCharge(r)
	}
	return n
}

// ServeHTTP is POST /v1/charges: it charges and answers 201 with the charge.
func (l *ledger) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := l.charge(r)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":"ch_%d"}`, n)
}

// ran reports how many times requests with key were executed.
func (l *ledger) ran(key string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.runs[key]
}

// made reports how many charges the provider made.
func (l *ledger) made() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.charges
}

// arrival is a request as it reached a server, before the middleware.
type arrival struct {
	key, contentType, body string
}

// arrivals records every request that reaches a server.
type arrivals struct {
	mu   sync.Mutex
	list []arrival
}

func (a *arrivals) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		a.mu.Lock()
		a.list = append(a.list, arrival{r.Header.Get("Idempotency-Key"), r.Header.Get("Content-Type"), string(body)})
		a.mu.Unlock()
		next.ServeHTTP(w, r)
	})
}

func (a *arrivals) all() []arrival {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]arrival(nil), a.list...)
}

// newGuard returns a Guard with a store of its own, as one instance of the
// service has, on the Redis at redisAddr, which other instances may share.
func newGuard(t *testing.T, redisAddr string, o idempotency.Options) *idempotency.Guard {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr})
	t.Cleanup(func() { _ = rdb.Close() })
	store, err := idempotency.NewRedisStore(rdb, idempotency.RedisOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	return idempotency.New(store, o)
}

// freshConnections returns an HTTP client that opens a connection for each
// request. net/http by itself sends a request again, once, when a reused
// connection fails before the answer and the request is replayable, which a
// POST is when it carries an Idempotency-Key (TestNetHTTPReplaysKeyedPost);
// on fresh connections every retry is the retrying client's own.
func freshConnections() *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.DisableKeepAlives = true
	return &http.Client{Transport: tr}
}

// serve starts an HTTP server for h on loopback, closed when t ends.
func serve(t *testing.T, h http.Handler) *httptest.Server {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}
