package clientcompat_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-retryablehttp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// The waits of every client made by newRetryClient, short so that the tests
// are quick: a wait of a second comes from a Retry-After.
const (
	retryWaitMin = 10 * time.Millisecond
	retryWaitMax = 100 * time.Millisecond
)

// backoff is one wait that a client's Backoff chose: after an answer with
// status (0 for a connection error), it waited wait.
type backoff struct {
	status int
	wait   time.Duration
}

// retries records what a retryablehttp client did. Its methods are safe for
// concurrent use.
type retries struct {
	// onBackoff, when set, runs in each backoff, before the wait, on the
	// goroutine that called Do: there a test changes the world the retry
	// will find.
	onBackoff func(resp *http.Response)

	attempts atomic.Int64 // requests sent, first attempts and retries

	mu       sync.Mutex
	backoffs []backoff
}

func (r *retries) waits() []backoff {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]backoff(nil), r.backoffs...)
}

// newRetryClient returns a go-retryablehttp client with its default retry
// policy (DefaultRetryPolicy) and backoff (DefaultBackoff), quiet, with short
// waits, on fresh connections, recording into rec.
func newRetryClient(rec *retries) *retryablehttp.Client {
	c := retryablehttp.NewClient()
	c.Logger = nil
	c.HTTPClient = freshConnections()
	c.RetryWaitMin, c.RetryWaitMax = retryWaitMin, retryWaitMax
	c.RequestLogHook = func(retryablehttp.Logger, *http.Request, int) { rec.attempts.Add(1) }
	c.Backoff = func(min, max time.Duration, attempt int, resp *http.Response) time.Duration {
		if rec.onBackoff != nil {
			rec.onBackoff(resp)
		}
		wait := retryablehttp.DefaultBackoff(min, max, attempt, resp)
		b := backoff{wait: wait}
		if resp != nil {
			b.status = resp.StatusCode
		}
		rec.mu.Lock()
		rec.backoffs = append(rec.backoffs, b)
		rec.mu.Unlock()
		return wait
	}
	return c
}

// retryConflicts is DefaultRetryPolicy that also retries 409, the
// middleware's answer when the original is still in flight after its wait.
func retryConflicts(ctx context.Context, resp *http.Response, err error) (bool, error) {
	if err == nil && ctx.Err() == nil && resp.StatusCode == http.StatusConflict {
		return true, nil
	}
	return retryablehttp.DefaultRetryPolicy(ctx, resp, err)
}

// answer is what a client got in the end.
type answer struct {
	status     int
	replayed   bool   // Idempotent-Replayed: true
	retryAfter string // Retry-After
	body       string
}

// post sends one charge through c to url, with key as its Idempotency-Key
// (none when key is ""), set once on the request as an application would.
func post(c *retryablehttp.Client, url, key string) (answer, error) {
	req, err := retryablehttp.NewRequest(http.MethodPost, url, []byte(`{"amount":4200,"currency":"usd"}`))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := c.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return answer{
		status:     resp.StatusCode,
		replayed:   resp.Header.Get("Idempotent-Replayed") == "true",
		retryAfter: resp.Header.Get("Retry-After"),
		body:       string(body),
	}, err
}

const chargesPath = "/v1/charges"

// The middleware's 503 for a store it cannot reach is retried, after the
// Retry-After it sends, which DefaultBackoff takes over its own schedule and
// its RetryWaitMax; the handler runs once, on the retry.
func TestRetryableHTTPRetriesStoreOutage(t *testing.T) {
	r := testserver.StartRedis(t)
	l := newLedger()
	srv := serve(t, newGuard(t, r.Addr, idempotency.Options{}).Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})(l))
	r.Stop(t)

	rec := &retries{onBackoff: func(*http.Response) { r.Restart(t) }}
	a, err := post(newRetryClient(rec), srv.URL+chargesPath, "outage-1")
	require.NoError(t, err)
	assert.Equal(t, answer{status: http.StatusCreated, body: `{"id":"ch_1"}`}, a)
	assert.Equal(t, 1, l.ran("outage-1"))
	assert.EqualValues(t, 2, rec.attempts.Load())
	assert.Equal(t, []backoff{{http.StatusServiceUnavailable, time.Second}}, rec.waits())
}

// An owner that charged and then lost its store is fenced off: its client
// gets 503, not the charge it cannot vouch for. retryablehttp retries with
// the same key; the retry, sent to the other instance as a load balancer
// might, takes the abandoned record over and runs the handler again, with
// the same DownstreamKey, so the provider charges once and the client gets
// that charge.
func TestRetryableHTTPRetriesFencedOwner(t *testing.T) {
	r := testserver.StartRedis(t)
	link := faultproxy.Start(t, r.Addr) // instance a's connection to Redis
	o := idempotency.Options{Lease: time.Second}
	causes, takeovers := make(chan error, 1), make(chan *idempotency.Info, 1)
	l := newLedger()
	l.afterCharge = func(r *http.Request) {
		info, _ := idempotency.FromContext(r.Context())
		if info.Attempt > 1 {
			takeovers <- info
			return
		}
		link.Partition()
		<-r.Context().Done()
		causes <- context.Cause(r.Context())
	}
	mw := idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant}
	a := serve(t, newGuard(t, link.Addr(), o).Middleware(mw)(l))
	t.Cleanup(link.Heal) // before a's store closes
	b := serve(t, newGuard(t, r.Addr, o).Middleware(mw)(l))

	rec := &retries{}
	c := newRetryClient(rec)
	c.PrepareRetry = func(req *http.Request) error {
		u := *req.URL
		u.Host = b.Listener.Addr().String()
		req.URL, req.Host = &u, u.Host
		return nil
	}
	ans, err := post(c, a.URL+chargesPath, "fenced-1")
	require.NoError(t, err)
	assert.Equal(t, answer{status: http.StatusCreated, body: `{"id":"ch_1"}`}, ans)
	// Both were sent before their answers went out.
	select {
	case err := <-causes:
		assert.ErrorIs(t, err, idempotency.ErrFenced)
	default:
		t.Error("the first execution's context did not end")
	}
	select {
	case info := <-takeovers:
		assert.True(t, info.Abandoned)
	default:
		t.Error("no takeover")
	}
	assert.Equal(t, 2, l.ran("fenced-1"))
	assert.Equal(t, 1, l.made())
	assert.Equal(t, []backoff{{http.StatusServiceUnavailable, time.Second}}, rec.waits())
}

// The middleware's 409 (the original still in flight when a duplicate's
// wait ends) goes back to the caller: DefaultRetryPolicy does not retry it.
// With retryConflicts it is retried, on DefaultBackoff's own schedule, since
// DefaultBackoff reads Retry-After on 429 and 503 only; the retry gets the
// original's stored answer.
func TestRetryableHTTPInFlightConflict(t *testing.T) {
	r := testserver.StartRedis(t)
	l := newLedger()
	started, held := make(chan struct{}), make(chan struct{})
	release := sync.OnceFunc(func() { close(held) })
	l.afterCharge = func(*http.Request) {
		close(started) // a second execution panics
		<-held
	}
	a := serve(t, newGuard(t, r.Addr, idempotency.Options{}).Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})(l))
	t.Cleanup(release) // before a closes, which waits for its handlers
	// b's duplicates do not wait for the original: they get 409 at once.
	b := serve(t, newGuard(t, r.Addr, idempotency.Options{WaitTimeout: -1}).Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, RetryAfter: 3 * time.Second})(l))

	type result struct {
		a   answer
		err error
	}
	original := make(chan result, 1)
	go func() {
		a, err := post(newRetryClient(&retries{}), a.URL+chargesPath, "conflict-1")
		original <- result{a, err}
	}()
	<-started

	plain := &retries{}
	ans, err := post(newRetryClient(plain), b.URL+chargesPath, "conflict-1")
	require.NoError(t, err)
	assert.Equal(t, http.StatusConflict, ans.status)
	assert.Equal(t, "3", ans.retryAfter)
	assert.EqualValues(t, 1, plain.attempts.Load())
	assert.Empty(t, plain.waits())

	var first result
	patient := &retries{onBackoff: func(*http.Response) {
		release()
		first = <-original
	}}
	c := newRetryClient(patient)
	c.CheckRetry = retryConflicts
	ans, err = post(c, b.URL+chargesPath, "conflict-1")
	require.NoError(t, err)
	require.NoError(t, first.err)
	assert.Equal(t, answer{status: http.StatusCreated, body: `{"id":"ch_1"}`}, first.a)
	assert.Equal(t, answer{status: http.StatusCreated, replayed: true, body: `{"id":"ch_1"}`}, ans)
	assert.EqualValues(t, 2, patient.attempts.Load())
	assert.Equal(t, []backoff{{http.StatusConflict, retryWaitMin}}, patient.waits())
	assert.Equal(t, 1, l.ran("conflict-1"))
}

// A handler's 429 is forgotten by the middleware's default disposition, so
// the retry, after the Retry-After that DefaultBackoff honours on 429, runs
// under the same key.
func TestRetryableHTTPRetryAfterOn429(t *testing.T) {
	r := testserver.StartRedis(t)
	l := newLedger()
	var limited atomic.Bool
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !limited.Swap(true) {
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		l.ServeHTTP(w, r)
	})
	srv := serve(t, newGuard(t, r.Addr, idempotency.Options{}).Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})(h))

	rec := &retries{}
	ans, err := post(newRetryClient(rec), srv.URL+chargesPath, "limited-1")
	require.NoError(t, err)
	assert.Equal(t, answer{status: http.StatusCreated, body: `{"id":"ch_1"}`}, ans)
	assert.Equal(t, 1, l.ran("limited-1"))
	assert.Equal(t, []backoff{{http.StatusTooManyRequests, time.Second}}, rec.waits())
}

// A reply lost after the server acted: retryablehttp sees a connection
// error and sends the request again, with every header it was given. With
// an Idempotency-Key the retry gets the stored charge, replayed; without
// one (the middleware lets it through, OptionalKey) the charge runs twice
// and the client learns only of the second.
func TestRetryableHTTPLostReply(t *testing.T) {
	r := testserver.StartRedis(t)
	for _, tc := range []struct {
		name, key string
		want      answer
		runs      int
	}{
		{"WithKey", "lost-1", answer{status: http.StatusCreated, replayed: true, body: `{"id":"ch_1"}`}, 1},
		{"WithoutKey", "", answer{status: http.StatusCreated, body: `{"id":"ch_2"}`}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLedger()
			var arr arrivals
			srv := serve(t, arr.wrap(newGuard(t, r.Addr, idempotency.Options{}).Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, OptionalKey: true})(l)))
			link := faultproxy.Start(t, srv.Listener.Addr().String())
			link.ResetOnNextRequest(true)

			rec := &retries{}
			ans, err := post(newRetryClient(rec), "http://"+link.Addr()+chargesPath, tc.key)
			require.NoError(t, err)
			assert.Equal(t, tc.want, ans)
			assert.Equal(t, tc.runs, l.ran(tc.key))
			assert.Equal(t, tc.runs, l.made())
			assert.Equal(t, []backoff{{0, retryWaitMin}}, rec.waits())
			got := arr.all()
			require.Len(t, got, 2)
			assert.Equal(t, tc.key, got[0].key)
			assert.Equal(t, got[0], got[1], "the retry is the same request")
		})
	}
}

// Duplicates of many keys, sent at once by many goroutines to two instances
// on one Redis, through links that lose requests and replies: each key's
// charge runs once, and every client of a key gets that charge.
func TestRetryableHTTPConcurrentDuplicates(t *testing.T) {
	// Each worker sends every key in turn, so the duplicates of a key are
	// in flight together, and faults keep landing as the keys go by.
	const workers, keys, faults = 8, 12, 8
	r := testserver.StartRedis(t)
	l := newLedger()
	var links [2]*faultproxy.Proxy
	for i := range links {
		srv := serve(t, newGuard(t, r.Addr, idempotency.Options{}).Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})(l))
		links[i] = faultproxy.Start(t, srv.Listener.Addr().String())
	}
	rec := &retries{}
	c := newRetryClient(rec)
	c.CheckRetry = retryConflicts
	c.RetryMax = 10

	// The first fault is armed before any request, so it cannot miss; each
	// of the others once the one before it has cost a client a backoff,
	// alternately losing a reply and a request, until the workers are done.
	links[0].ResetOnNextRequest(true)
	done := make(chan struct{})
	var injector sync.WaitGroup
	injector.Go(func() {
		for i := 1; i < faults; i++ {
			for len(rec.waits()) < i {
				select {
				case <-done:
					return
				case <-time.After(time.Millisecond):
				}
			}
			links[i%2].ResetOnNextRequest(i%2 == 0)
		}
	})

	start := make(chan struct{})
	var answers [keys][workers]answer
	var errs [keys][workers]error
	var clients sync.WaitGroup
	for w := range workers {
		clients.Go(func() {
			<-start
			for k := range keys {
				url := "http://" + links[(w+k)%2].Addr() + chargesPath
				answers[k][w], errs[k][w] = post(c, url, fmt.Sprintf("dup-%d", k))
			}
		})
	}
	close(start)
	clients.Wait()
	close(done)
	injector.Wait()

	for k := range keys {
		key := fmt.Sprintf("dup-%d", k)
		assert.Equal(t, 1, l.ran(key), key)
		executed := 0
		for w := range workers {
			require.NoError(t, errs[k][w], key)
			a := answers[k][w]
			assert.Equal(t, http.StatusCreated, a.status, key)
			assert.Equal(t, answers[k][0].body, a.body, key)
			if !a.replayed {
				executed++
			}
		}
		assert.LessOrEqual(t, executed, 1, key)
	}
	assert.Equal(t, keys, l.made())
	assert.Greater(t, rec.attempts.Load(), int64(workers*keys), "no fault fired")
	t.Logf("%d attempts for %d requests", rec.attempts.Load(), workers*keys)
}

// net/http's Transport, with no retrying client above it, sends a request
// again by itself when a reused connection fails before the first byte of
// the answer and the request can be replayed, which a POST with a body it
// can rewind can be when it carries an Idempotency-Key: the replay gets the
// stored charge. Without a key it does not, and the caller gets the error
// though the charge was made.
func TestNetHTTPReplaysKeyedPost(t *testing.T) {
	r := testserver.StartRedis(t)
	for _, tc := range []struct {
		name, key string
		sent      int
	}{
		{"WithKey", "nethttp-1", 2},
		{"WithoutKey", "", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLedger()
			var arr arrivals
			srv := serve(t, arr.wrap(newGuard(t, r.Addr, idempotency.Options{}).Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, OptionalKey: true})(l)))
			link := faultproxy.Start(t, srv.Listener.Addr().String())
			c := &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}
			t.Cleanup(c.CloseIdleConnections)
			send := func(key string) (*http.Response, error) {
				req, err := http.NewRequest(http.MethodPost, "http://"+link.Addr()+chargesPath, bytes.NewReader([]byte(`{"amount":4200}`)))
				require.NoError(t, err)
				if key != "" {
					req.Header.Set("Idempotency-Key", key)
				}
				return c.Do(req)
			}
			// A first request leaves an idle connection for the second.
			resp, err := send("warm-up-" + tc.name)
			require.NoError(t, err)
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()

			link.ResetOnNextRequest(true)
			resp, err = send(tc.key)
			if tc.key == "" {
				assert.Error(t, err)
			} else {
				require.NoError(t, err)
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				assert.Equal(t, "true", resp.Header.Get("Idempotent-Replayed"))
				assert.JSONEq(t, `{"id":"ch_2"}`, string(body))
			}
			assert.Equal(t, 1, l.ran(tc.key))
			assert.Equal(t, 2, l.made(), "the warm-up's charge and this one")
			assert.Len(t, arr.all(), 1+tc.sent)
		})
	}
}
