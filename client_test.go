package idempotency_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// fast retries at once, so that only a Retry-After makes a test wait.
var fast = idempotency.RetryPolicy{BaseDelay: time.Millisecond, MaxDelay: 10 * time.Second}

// hangGuard bounds every logical request of these tests: it only catches a
// hang, never a slow machine.
const hangGuard = 30 * time.Second

// attempt is what a scripted server saw of one request.
type attempt struct {
	keys   []string // the Idempotency-Key fields
	body   string
	at     time.Time
	remote string
}

// reply is a scripted server's answer to one attempt.
type reply struct {
	status int
	header map[string]string
	drop   bool // close the connection without an answer: a network error
}

// script is an HTTP server that answers the nth request with the nth reply
// (the last one once they run out), with "attempt n" as the body, and
// records every request.
type script struct {
	url     string
	replies []reply

	mu   sync.Mutex
	seen []attempt
}

func serveScript(t *testing.T, replies ...reply) *script {
	t.Helper()
	s := &script{replies: replies}
	srv := httptest.NewServer(http.HandlerFunc(s.serve))
	t.Cleanup(srv.Close)
	s.url = srv.URL
	return s
}

func (s *script) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	n := len(s.seen) + 1
	s.seen = append(s.seen, attempt{keys: r.Header.Values(idempotency.HeaderKey), body: string(body), at: time.Now(), remote: r.RemoteAddr})
	rep := s.replies[min(n, len(s.replies))-1]
	s.mu.Unlock()
	if rep.drop {
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			_ = conn.Close()
		}
		return
	}
	for name, v := range rep.header {
		w.Header().Set(name, v)
	}
	w.WriteHeader(rep.status)
	fmt.Fprintf(w, "attempt %d", n)
}

func (s *script) attempts() []attempt {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.seen)
}

// newBase returns an http.Transport of the test's own. Without keep-alives
// every attempt gets a new connection, on which net/http never resends a
// request by itself, so a server sees exactly the attempts the Transport
// made.
func newBase(t *testing.T, keepAlives bool) *http.Transport {
	base := &http.Transport{DisableKeepAlives: !keepAlives}
	t.Cleanup(base.CloseIdleConnections)
	return base
}

func newRequest(t *testing.T, method, url, body string) *http.Request {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), hangGuard)
	t.Cleanup(cancel)
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, r)
	require.NoError(t, err)
	return req
}

// roundTrip sends req through tr and returns the response with its body.
func roundTrip(t *testing.T, tr http.RoundTripper, req *http.Request) (*http.Response, string) {
	t.Helper()
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, string(body)
}

// oneKey checks that every attempt carried one Idempotency-Key field, the
// same in all, and returns it.
func oneKey(t *testing.T, seen []attempt) string {
	t.Helper()
	require.NotEmpty(t, seen)
	for i, a := range seen {
		require.Len(t, a.keys, 1, "attempt %d: Idempotency-Key fields", i+1)
		require.Equal(t, seen[0].keys[0], a.keys[0], "attempt %d's key differs from the first's", i+1)
	}
	return seen[0].keys[0]
}

// roundTripFunc is a RoundTripper made of a function, for bases that fail
// or report on demand.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func TestTransportRetriesStatusesAndNetworkErrors(t *testing.T) {
	for _, tc := range []struct {
		name  string
		first reply
		retry bool
	}{
		{"409", reply{status: 409}, true},
		{"429", reply{status: 429}, true},
		{"502", reply{status: 502}, true},
		{"503", reply{status: 503}, true},
		{"504", reply{status: 504}, true},
		{"network error", reply{drop: true}, true},
		{"400", reply{status: 400}, false},
		{"422", reply{status: 422}, false},
		{"500", reply{status: 500}, false},
		{"200", reply{status: 200}, false},
		{"201", reply{status: 201}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := serveScript(t, tc.first, reply{status: 201})
			tr := &idempotency.Transport{Base: newBase(t, false), Retry: fast}
			resp, body := roundTrip(t, tr, newRequest(t, http.MethodPost, s.url, "charge"))
			want, wantStatus := 1, tc.first.status
			if tc.retry {
				want, wantStatus = 2, 201
			}
			seen := s.attempts()
			require.Len(t, seen, want, "attempts")
			assert.Equal(t, wantStatus, resp.StatusCode)
			assert.Equal(t, fmt.Sprintf("attempt %d", want), body, "the response is the last attempt's")
			assert.Equal(t, oneKey(t, seen), resp.Request.Header.Get(idempotency.HeaderKey), "resp.Request carries the key used")
		})
	}
}

func TestTransportStripeShouldRetry(t *testing.T) {
	for _, tc := range []struct {
		name   string
		status int
		should string
		retry  bool
	}{
		{"false stops a retryable status", 503, "false", false},
		{"false stops 409", 409, "false", false},
		{"true retries 500", 500, "true", true},
		{"true retries 404", 404, "true", true},
		{"true never retries 400", 400, "true", false},
		{"true never retries 422", 422, "true", false},
		{"true does not retry a success", 201, "true", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := serveScript(t, reply{status: tc.status, header: map[string]string{"Stripe-Should-Retry": tc.should}}, reply{status: 200})
			tr := &idempotency.Transport{Base: newBase(t, false), Retry: fast}
			resp, _ := roundTrip(t, tr, newRequest(t, http.MethodPost, s.url, "charge"))
			want, wantStatus := 1, tc.status
			if tc.retry {
				want, wantStatus = 2, 200
			}
			require.Len(t, s.attempts(), want, "attempts")
			assert.Equal(t, wantStatus, resp.StatusCode)
		})
	}
}

func TestTransportWaitsRetryAfter(t *testing.T) {
	for _, tc := range []struct {
		name  string
		value func() string // made when the subtest starts, as a date is relative to now
		// earliest is when the retry may arrive at the soonest, given when
		// the first attempt did (which is before its answer left).
		earliest func(first time.Time, value string) time.Time
	}{
		{
			"delta-seconds",
			func() string { return "1" },
			func(first time.Time, _ string) time.Time { return first.Add(time.Second) },
		},
		{
			"HTTP-date",
			func() string { return time.Now().Add(2 * time.Second).UTC().Format(http.TimeFormat) },
			func(_ time.Time, value string) time.Time { at, _ := http.ParseTime(value); return at },
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			value := tc.value()
			s := serveScript(t, reply{status: 503, header: map[string]string{"Retry-After": value}}, reply{status: 201})
			tr := &idempotency.Transport{Base: newBase(t, false), Retry: fast}
			resp, _ := roundTrip(t, tr, newRequest(t, http.MethodPost, s.url, "charge"))
			assert.Equal(t, 201, resp.StatusCode)
			seen := s.attempts()
			require.Len(t, seen, 2)
			if earliest := tc.earliest(seen[0].at, value); seen[1].at.Before(earliest) {
				t.Errorf("retry arrived at %v, before Retry-After allowed it (%v)", seen[1].at, earliest)
			}
		})
	}
}

func TestTransportReturnsRetryAfterBeyondMaxDelay(t *testing.T) {
	for _, tc := range []struct{ name, value string }{
		{"delta-seconds", "2"},
		{"HTTP-date", time.Now().Add(time.Hour).UTC().Format(http.TimeFormat)},
		{"delta-seconds beyond uint64", "99999999999999999999999"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := serveScript(t, reply{status: 429, header: map[string]string{"Retry-After": tc.value}}, reply{status: 201})
			tr := &idempotency.Transport{Base: newBase(t, false), Retry: idempotency.RetryPolicy{BaseDelay: time.Millisecond, MaxDelay: time.Second}}
			resp, _ := roundTrip(t, tr, newRequest(t, http.MethodPost, s.url, "charge"))
			assert.Equal(t, 429, resp.StatusCode)
			assert.Equal(t, tc.value, resp.Header.Get("Retry-After"))
			assert.Len(t, s.attempts(), 1)
		})
	}
}

func TestTransportRewindsBody(t *testing.T) {
	s := serveScript(t, reply{status: 503}, reply{drop: true}, reply{status: 201})
	tr := &idempotency.Transport{Base: newBase(t, false), Retry: fast}
	resp, _ := roundTrip(t, tr, newRequest(t, http.MethodPost, s.url, `{"amount":100}`))
	assert.Equal(t, 201, resp.StatusCode)
	seen := s.attempts()
	require.Len(t, seen, 3)
	for i, a := range seen {
		assert.Equal(t, `{"amount":100}`, a.body, "attempt %d's body", i+1)
	}
}

func TestTransportSendsUnreplayableBodyOnce(t *testing.T) {
	for _, tc := range []struct {
		name  string
		first reply
	}{
		{"retryable status", reply{status: 503}},
		{"network error", reply{drop: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := serveScript(t, tc.first, reply{status: 201})
			tr := &idempotency.Transport{Base: newBase(t, false), Retry: fast}
			req := newRequest(t, http.MethodPost, s.url, "")
			// A body that can be read once: http.NewRequest cannot rewind it.
			req.Body = io.NopCloser(strings.NewReader("charge"))
			req.ContentLength = int64(len("charge"))
			resp, err := tr.RoundTrip(req)
			if tc.first.drop {
				require.Error(t, err)
				assert.Contains(t, err.Error(), "attempt 1")
			} else {
				require.NoError(t, err)
				resp.Body.Close()
				assert.Equal(t, 503, resp.StatusCode)
			}
			seen := s.attempts()
			require.Len(t, seen, 1, "attempts")
			assert.Equal(t, "charge", seen[0].body)
			oneKey(t, seen)
		})
	}
}

func TestTransportKeepsCallerKey(t *testing.T) {
	s := serveScript(t, reply{status: 409}, reply{drop: true}, reply{status: 201})
	tr := &idempotency.Transport{Base: newBase(t, false), Retry: fast}
	req := newRequest(t, http.MethodPost, s.url, "charge")
	req.Header.Set(idempotency.HeaderKey, `"order-7f3a"`)
	resp, _ := roundTrip(t, tr, req)
	seen := s.attempts()
	require.Len(t, seen, 3)
	assert.Equal(t, `"order-7f3a"`, oneKey(t, seen))
	assert.Equal(t, `"order-7f3a"`, resp.Request.Header.Get(idempotency.HeaderKey))
}

// A key field the server would refuse (empty, malformed, repeated) fails
// the request before anything is sent: an empty Idempotency-Key would reach
// a server that does not check it as no key at all.
func TestTransportRefusesInvalidKey(t *testing.T) {
	s := serveScript(t, reply{status: 201})
	tr := &idempotency.Transport{Base: newBase(t, false), Retry: fast}
	for name, values := range map[string][]string{
		"empty": {""}, "blank": {"  "}, "quoted empty": {`""`}, "space": {"a b"},
		"unterminated": {`"abc`}, "repeated": {"a", "b"}, "too long": {strings.Repeat("k", idempotency.MaxKeyLength+1)},
	} {
		t.Run(name, func(t *testing.T) {
			req := newRequest(t, http.MethodPost, s.url, "charge")
			req.Header[idempotency.HeaderKey] = values
			resp, err := tr.RoundTrip(req)
			require.ErrorIs(t, err, idempotency.ErrInvalidKey)
			assert.Nil(t, resp)
		})
	}
	assert.Empty(t, s.attempts(), "nothing sent")
}

func TestTransportMakesOneKeyPerRequest(t *testing.T) {
	s := serveScript(t, reply{status: 503}, reply{drop: true}, reply{status: 201}, reply{status: 503}, reply{status: 201})
	tr := &idempotency.Transport{Base: newBase(t, false), Retry: fast}
	roundTrip(t, tr, newRequest(t, http.MethodPost, s.url, "charge"))
	roundTrip(t, tr, newRequest(t, http.MethodPost, s.url, "charge"))
	seen := s.attempts()
	require.Len(t, seen, 5)
	first, second := oneKey(t, seen[:3]), oneKey(t, seen[3:])
	assert.NotEqual(t, first, second, "two logical requests share a key")
	// 26 characters of base32 or more: 130 bits or more.
	base32 := regexp.MustCompile(`^[A-Z2-7]{26,}$`)
	for _, k := range []string{first, second} {
		assert.Regexp(t, base32, k)
		assert.NoError(t, idempotency.Key{Name: k}.Validate())
	}
}

func TestTransportBoundsAttempts(t *testing.T) {
	for _, tc := range []struct {
		name   string
		policy idempotency.RetryPolicy
		want   int
	}{
		{"one", idempotency.RetryPolicy{MaxAttempts: 1}, 1},
		{"three", idempotency.RetryPolicy{MaxAttempts: 3, BaseDelay: time.Millisecond}, 3},
		{"default", idempotency.RetryPolicy{}, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := serveScript(t, reply{status: 503})
			tr := &idempotency.Transport{Base: newBase(t, false), Retry: tc.policy}
			resp, body := roundTrip(t, tr, newRequest(t, http.MethodPost, s.url, "charge"))
			assert.Len(t, s.attempts(), tc.want)
			assert.Equal(t, 503, resp.StatusCode)
			assert.Equal(t, fmt.Sprintf("attempt %d", tc.want), body)
		})
	}
}

func TestTransportGivesUpOnNetworkErrors(t *testing.T) {
	errDown := errors.New("connection refused")
	var calls atomic.Int32
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		if r.Body != nil {
			_ = r.Body.Close()
		}
		return nil, fmt.Errorf("dial, try %d: %w", calls.Add(1), errDown)
	})
	tr := &idempotency.Transport{Base: base, Retry: idempotency.RetryPolicy{MaxAttempts: 3, BaseDelay: time.Millisecond}}
	_, err := tr.RoundTrip(newRequest(t, http.MethodPost, "http://example.invalid/charges", "charge"))
	require.ErrorIs(t, err, errDown)
	assert.Equal(t, int32(3), calls.Load())
	assert.Contains(t, err.Error(), "after attempt 3")
	assert.Contains(t, err.Error(), "try 3", "the error is the last attempt's")
}

func TestTransportStopsOnContext(t *testing.T) {
	t.Run("during the wait", func(t *testing.T) {
		// The server asks for an hour; the caller gives up after its answer.
		s := serveScript(t, reply{status: 503, header: map[string]string{"Retry-After": "3600"}})
		inner := newBase(t, false)
		answered := make(chan struct{}, 1)
		base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
			resp, err := inner.RoundTrip(r)
			answered <- struct{}{}
			return resp, err
		})
		tr := &idempotency.Transport{Base: base, Retry: idempotency.RetryPolicy{MaxDelay: 2 * time.Hour}}
		cancelDuring(t, tr, s.url, answered)
		assert.Len(t, s.attempts(), 1)
	})
	t.Run("during an attempt", func(t *testing.T) {
		var attempts atomic.Int32
		arrived := make(chan struct{}, 1)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			attempts.Add(1)
			// The server notices a client gone only once the body is read.
			_, _ = io.ReadAll(r.Body)
			arrived <- struct{}{}
			<-r.Context().Done()
		}))
		t.Cleanup(srv.Close)
		tr := &idempotency.Transport{Base: newBase(t, false), Retry: fast}
		cancelDuring(t, tr, srv.URL, arrived)
		assert.Equal(t, int32(1), attempts.Load())
	})
}

// cancelDuring sends a POST to url through tr, cancels its context once
// reached fires, and checks that RoundTrip then returns the context's error
// rather than going on.
func cancelDuring(t *testing.T, tr *idempotency.Transport, url string, reached <-chan struct{}) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	req := newRequest(t, http.MethodPost, url, "charge").WithContext(ctx)
	done := make(chan error, 1)
	go func() {
		resp, err := tr.RoundTrip(req)
		if resp != nil {
			resp.Body.Close()
		}
		done <- err
	}()
	<-reached
	cancel()
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(hangGuard):
		t.Fatal("RoundTrip still going after its context was cancelled")
	}
}

func TestTransportLeavesRequestAlone(t *testing.T) {
	s := serveScript(t, reply{status: 503}, reply{drop: true}, reply{status: 201})
	tr := &idempotency.Transport{Base: newBase(t, false), Retry: fast}
	req := newRequest(t, http.MethodPost, s.url, "charge")
	req.Header.Set("X-Account", "acct_1")
	header, u, body, ctx := req.Header.Clone(), *req.URL, req.Body, req.Context()
	resp, _ := roundTrip(t, tr, req)
	assert.Equal(t, header, req.Header)
	assert.Empty(t, req.Header.Values(idempotency.HeaderKey))
	assert.Equal(t, u, *req.URL)
	assert.True(t, body == req.Body, "the caller's Body was replaced")
	assert.Equal(t, ctx, req.Context())
	assert.NotSame(t, req, resp.Request)
	assert.Equal(t, "acct_1", resp.Request.Header.Get("X-Account"))
}

func TestTransportGuardsMethods(t *testing.T) {
	for _, tc := range []struct {
		methods []string
		method  string
		guarded bool
	}{
		{nil, http.MethodPost, true},
		{nil, http.MethodPatch, true},
		{nil, http.MethodGet, false},
		{nil, http.MethodPut, false},
		{nil, http.MethodDelete, false},
		{[]string{http.MethodPut}, http.MethodPut, true},
		{[]string{http.MethodPut}, http.MethodPost, false},
	} {
		t.Run(fmt.Sprintf("%v %s", tc.methods, tc.method), func(t *testing.T) {
			s := serveScript(t, reply{status: 503}, reply{status: 201})
			inner := newBase(t, false)
			var sent []*http.Request
			base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
				sent = append(sent, r)
				return inner.RoundTrip(r)
			})
			tr := &idempotency.Transport{Base: base, Methods: tc.methods, Retry: fast}
			req := newRequest(t, tc.method, s.url, "")
			resp, _ := roundTrip(t, tr, req)
			seen := s.attempts()
			if tc.guarded {
				require.Len(t, seen, 2)
				oneKey(t, seen)
				assert.Equal(t, 201, resp.StatusCode)
				return
			}
			require.Len(t, seen, 1)
			assert.Empty(t, seen[0].keys, "a key was added to an unguarded request")
			assert.Equal(t, []*http.Request{req}, sent, "Base got something other than the caller's request")
			assert.Equal(t, 503, resp.StatusCode)
		})
	}
}

func TestTransportReusesConnections(t *testing.T) {
	s := serveScript(t, reply{status: 503}, reply{status: 429}, reply{status: 201})
	tr := &idempotency.Transport{Base: newBase(t, true), Retry: fast}
	resp, _ := roundTrip(t, tr, newRequest(t, http.MethodPost, s.url, "charge"))
	assert.Equal(t, 201, resp.StatusCode)
	seen := s.attempts()
	require.Len(t, seen, 3)
	for i, a := range seen {
		assert.Equal(t, seen[0].remote, a.remote, "attempt %d came on a new connection: a discarded response was not drained", i+1)
	}
}

func TestTransportCloseIdleConnections(t *testing.T) {
	s := serveScript(t, reply{status: 201})
	base := newBase(t, true)
	client := &http.Client{Transport: &idempotency.Transport{Base: base}}
	for range 2 {
		resp, err := client.Post(s.url, "text/plain", strings.NewReader("charge"))
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		client.CloseIdleConnections()
	}
	seen := s.attempts()
	require.Len(t, seen, 2)
	assert.NotEqual(t, seen[0].remote, seen[1].remote, "the idle connection survived client.CloseIdleConnections")
}

// chargeAPI is a real server: a handler that counts its executions behind
// the library's middleware, reached through a fault proxy. It records the
// key of every request that reaches it.
type chargeAPI struct {
	url   string
	proxy *faultproxy.Proxy

	mu         sync.Mutex
	executions int
	keys       []string
}

func startChargeAPI(t *testing.T, store idempotency.Store) *chargeAPI {
	t.Helper()
	a := &chargeAPI{}
	guarded := idempotency.New(store, idempotency.Options{}).Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			a.mu.Lock()
			a.executions++
			n := a.executions
			a.mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"charge":%d}`, n)
		}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.mu.Lock()
		a.keys = append(a.keys, r.Header.Get(idempotency.HeaderKey))
		a.mu.Unlock()
		guarded.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	a.proxy = faultproxy.Start(t, srv.Listener.Addr().String())
	a.url = "http://" + a.proxy.Addr() + "/charges"
	return a
}

func (a *chargeAPI) seen() (executions int, keys []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.executions, slices.Clone(a.keys)
}

func newRedisStore(t *testing.T) idempotency.Store {
	t.Helper()
	store, err := idempotency.NewRedisStore(testserver.StartRedis(t).Client(), idempotency.RedisOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	return store
}

func TestTransportRunsOnceWhenRepliesAreLost(t *testing.T) {
	for _, st := range []struct {
		name  string
		store func(t *testing.T) idempotency.Store
	}{
		{"memory", func(*testing.T) idempotency.Store { return idempotency.NewMemoryStore(idempotency.MemoryOptions{}) }},
		{"redis", newRedisStore},
	} {
		t.Run(st.name, func(t *testing.T) {
			store := st.store(t)
			t.Run("a new key per attempt runs it twice", func(t *testing.T) {
				api := startChargeAPI(t, store)
				// The first request reaches the server, which charges; its
				// reply is lost.
				api.proxy.ResetOnNextRequest(true)
				client := &http.Client{Transport: newBase(t, true)}
				var resp *http.Response
				for try := 1; resp == nil; try++ {
					require.LessOrEqual(t, try, 4, "the naive loop never got an answer")
					req := newRequest(t, http.MethodPost, api.url, `{"amount":100}`)
					req.Header.Set(idempotency.HeaderKey, rand.Text())
					var err error
					if resp, err = client.Do(req); err == nil {
						defer resp.Body.Close()
					}
				}
				executions, keys := api.seen()
				assert.Equal(t, 2, executions, "charges made")
				assert.Len(t, keys, 2)
			})
			t.Run("Transport runs it once", func(t *testing.T) {
				api := startChargeAPI(t, store)
				api.proxy.ResetOnNextRequest(true)
				client := &http.Client{Transport: &idempotency.Transport{Base: newBase(t, true), Retry: fast}}
				req := newRequest(t, http.MethodPost, api.url, `{"amount":100}`)
				resp, err := client.Do(req)
				require.NoError(t, err)
				defer resp.Body.Close()
				body, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				assert.Equal(t, http.StatusCreated, resp.StatusCode)
				assert.Equal(t, "true", resp.Header.Get(idempotency.HeaderReplayed))
				assert.JSONEq(t, `{"charge":1}`, string(body), "the caller gets the first execution's answer")
				executions, keys := api.seen()
				assert.Equal(t, 1, executions, "charges made")
				require.Len(t, keys, 2, "attempts that reached the server")
				assert.Equal(t, keys[0], keys[1])
				assert.Equal(t, keys[0], resp.Request.Header.Get(idempotency.HeaderKey))
			})
		})
	}
}

// net/http's Transport resends a request with an Idempotency-Key by itself
// when a reused connection fails before the reply's first byte: the key is
// what makes that safe.
func TestHTTPTransportResendsKeyedRequest(t *testing.T) {
	api := startChargeAPI(t, idempotency.NewMemoryStore(idempotency.MemoryOptions{}))
	// One attempt per logical request: any resend is net/http's own.
	tr := &idempotency.Transport{Base: newBase(t, true), Retry: idempotency.RetryPolicy{MaxAttempts: 1}}
	resp, _ := roundTrip(t, tr, newRequest(t, http.MethodPost, api.url, `{"amount":100}`))
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	// The next request goes out on the idle connection the first left, and
	// its reply is lost after the server charged.
	api.proxy.ResetOnNextRequest(true)
	resp, body := roundTrip(t, tr, newRequest(t, http.MethodPost, api.url, `{"amount":200}`))
	assert.Equal(t, http.StatusCreated, resp.StatusCode)
	assert.Equal(t, "true", resp.Header.Get(idempotency.HeaderReplayed))
	assert.JSONEq(t, `{"charge":2}`, body)
	executions, keys := api.seen()
	assert.Equal(t, 2, executions, "charges made for two logical requests")
	require.Len(t, keys, 3, "requests that reached the server")
	assert.Equal(t, keys[1], keys[2], "net/http's resend carries the second request's key")
}

// balancer spreads attempts over several addresses, as a load balancer in
// front of several instances would.
type balancer struct {
	base  http.RoundTripper
	hosts []string
	next  atomic.Uint64
}

func (b *balancer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.URL.Host = b.hosts[b.next.Add(1)%uint64(len(b.hosts))]
	return b.base.RoundTrip(r)
}

func TestTransportConcurrentCallersRedis(t *testing.T) {
	rdb := testserver.StartRedis(t)
	var mu sync.Mutex
	executions := map[string]int{}
	var proxies []*faultproxy.Proxy
	var hosts []string
	for range 2 {
		store, err := idempotency.NewRedisStore(rdb.Client(), idempotency.RedisOptions{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = store.Close() })
		handler := idempotency.New(store, idempotency.Options{}).Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})(
			http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				op, _ := io.ReadAll(r.Body)
				mu.Lock()
				executions[string(op)]++
				mu.Unlock()
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write(op)
			}))
		srv := httptest.NewServer(handler)
		t.Cleanup(srv.Close)
		p := faultproxy.Start(t, srv.Listener.Addr().String())
		proxies = append(proxies, p)
		hosts = append(hosts, p.Addr())
	}
	base := newBase(t, true)
	const callers, each = 8, 25
	// answered counts attempts that got a response. Each fault waits for
	// callers/2 more of them: on the 3ms cadence alone, a loaded CI machine
	// answered fewer requests than the faults reset, and one request met a
	// reset on each of its 40 attempts. Gated this way, between two faults
	// at least 4 attempts are answered while a fault resets 1 attempt, or
	// at most 8 for one fault in 4, however slow the machine is.
	var answered atomic.Int64
	tr := &idempotency.Transport{
		Base: &balancer{hosts: hosts, base: roundTripFunc(func(r *http.Request) (*http.Response, error) {
			resp, err := base.RoundTrip(r)
			if err == nil {
				answered.Add(1)
			}
			return resp, err
		})},
		Retry: idempotency.RetryPolicy{MaxAttempts: 40, BaseDelay: 2 * time.Millisecond, MaxDelay: 100 * time.Millisecond},
	}

	// Faults while the callers run: replies lost after the server acted,
	// and every open connection reset, idle or busy.
	stop := make(chan struct{})
	var faults sync.WaitGroup
	faults.Go(func() {
		since := answered.Load()
		for i := 0; ; {
			select {
			case <-stop:
				return
			case <-time.After(3 * time.Millisecond):
			}
			n := answered.Load()
			if n-since < callers/2 {
				continue
			}
			since = n
			if p := proxies[i%len(proxies)]; i%4 == 3 {
				p.ResetAll()
			} else {
				p.ResetOnNextRequest(true)
			}
			i++
		}
	})

	ctx, cancel := context.WithTimeout(t.Context(), hangGuard)
	defer cancel()
	var replayed atomic.Int32
	var wg sync.WaitGroup
	for c := range callers {
		wg.Go(func() {
			for i := range each {
				op := fmt.Sprintf("op-%d-%d", c, i)
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://instances/charges", strings.NewReader(op))
				if err != nil {
					t.Error(err)
					return
				}
				resp, err := tr.RoundTrip(req)
				if err != nil {
					t.Errorf("%s: %v", op, err)
					continue
				}
				body, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil || resp.StatusCode != http.StatusCreated || string(body) != op {
					t.Errorf("%s: got %d %q (%v), want 201 and its own answer", op, resp.StatusCode, body, err)
				}
				if resp.Header.Get(idempotency.HeaderReplayed) == "true" {
					replayed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	faults.Wait()

	mu.Lock()
	defer mu.Unlock()
	assert.Len(t, executions, callers*each, "operations executed")
	for op, n := range executions {
		if n != 1 {
			t.Errorf("%s executed %d times", op, n)
		}
	}
	// Without a fault that lost a reply after the server acted, nothing is
	// replayed, and the test would prove nothing.
	assert.Positive(t, replayed.Load(), "answers replayed after lost replies")
	t.Logf("%d logical requests, %d answered by a replay", callers*each, replayed.Load())
}

func TestRetryPolicyBackoffUnbounded(t *testing.T) {
	// A client that honours any Retry-After sets the longest MaxDelay; its
	// bound, plus one for the closed interval, must not overflow.
	p := idempotency.RetryPolicy{MaxDelay: math.MaxInt64}
	for _, attempt := range []int{1, 62, 63, 1000} {
		if d := p.Backoff(attempt); d < 0 {
			t.Errorf("Backoff(%d) = %v, want non-negative", attempt, d)
		}
	}
}
