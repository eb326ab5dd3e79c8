package idempotencyecho_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/labstack/echo/v4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	idempotencyecho "github.com/idempotency-go/idempotency/echo"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// answer is what a client read.
type answer struct {
	status   int
	header   http.Header
	body     string
	replayed bool
}

// sendTo POSTs body with the key to url over real HTTP. It may run on a
// goroutine of its own: a failure is reported, and the answer is zero.
func sendTo(t *testing.T, url, key, body string) answer {
	req, err := http.NewRequest(http.MethodPost, url+"/v1/charges", strings.NewReader(body))
	if !assert.NoError(t, err) {
		return answer{}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Account-ID", "acct_1")
	req.Header.Set(idempotency.HeaderKey, key)
	res, err := http.DefaultClient.Do(req)
	if !assert.NoError(t, err) {
		return answer{}
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	assert.NoError(t, err)
	h := res.Header.Clone()
	h.Del("Date")
	replayed := h.Get(idempotency.HeaderReplayed) == "true"
	h.Del(idempotency.HeaderReplayed)
	return answer{res.StatusCode, h, string(b), replayed}
}

// TestRedisEndToEnd: two instances, each an echo server with its own Guard
// on one redis-server, run a charge once between them, however the
// client's attempts are spread: each answer is the one run's, byte for
// byte. A failure answered with an echo.HTTPError 503 on one instance is
// released, and the retry on the other runs it again as the same
// operation.
func TestRedisEndToEnd(t *testing.T) {
	srv := testserver.StartRedis(t)
	var runs atomic.Int64
	var failed sync.Map // operation IDs answered 503 once: a retry as another operation fails again
	charge := createCharge(&runs)
	instance := func() string {
		store, err := idempotency.NewRedisStore(srv.Client(), idempotency.RedisOptions{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = store.Close() })
		e := newEcho()
		e.Use(recoverQuietly)
		e.POST("/v1/charges", func(c echo.Context) error {
			info, _ := idempotency.FromContext(c.Request().Context())
			if c.Request().Header.Get(idempotency.HeaderKey) == "order-503" {
				if _, again := failed.LoadOrStore(info.OperationID, true); !again {
					return echo.NewHTTPError(http.StatusServiceUnavailable, "gateway down")
				}
			}
			return charge(c)
		}, idempotencyecho.Middleware(idempotency.New(store, idempotency.Options{}), idempotency.MiddlewareOptions{
			Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil },
		}))
		hs := httptest.NewServer(e)
		t.Cleanup(hs.Close)
		return hs.URL
	}
	a, b := instance(), instance()

	const n = 10
	answers := make([]answer, 2*n)
	var wg sync.WaitGroup
	for i := range answers {
		url := a
		if i%2 == 1 {
			url = b
		}
		wg.Go(func() { answers[i] = sendTo(t, url, "order-1842", `{"amount":4200}`) })
	}
	wg.Wait()
	assert.Equal(t, int64(1), runs.Load(), "handler runs")
	replayed := 0
	for _, got := range answers {
		assert.Equal(t, http.StatusCreated, got.status)
		assert.JSONEq(t, `{"id":"ch_1","amount":4200}`, got.body)
		assert.Equal(t, answers[0].header, got.header)
		assert.Equal(t, answers[0].body, got.body)
		if got.replayed {
			replayed++
		}
	}
	assert.Equal(t, 2*n-1, replayed)

	reused := sendTo(t, b, "order-1842", `{"amount":1}`)
	assert.Equal(t, http.StatusUnprocessableEntity, reused.status)

	down := sendTo(t, a, "order-503", `{"amount":5}`)
	assert.Equal(t, http.StatusServiceUnavailable, down.status)
	assert.JSONEq(t, `{"message":"gateway down"}`, down.body)
	retried := sendTo(t, b, "order-503", `{"amount":5}`)
	assert.Equal(t, http.StatusCreated, retried.status)
	assert.JSONEq(t, `{"id":"ch_2","amount":5}`, retried.body)
	assert.False(t, retried.replayed)
	assert.Equal(t, retried.withReplayed(true), sendTo(t, a, "order-503", `{"amount":5}`))
	assert.Equal(t, int64(2), runs.Load())
}

// withReplayed is a with its replayed mark set to r.
func (a answer) withReplayed(r bool) answer {
	a.replayed = r
	return a
}

// redisGuard is a Guard of its own on srv, as one instance of a service.
func redisGuard(t *testing.T, srv *testserver.Redis) *idempotency.Guard {
	store, err := idempotency.NewRedisStore(srv.Client(), idempotency.RedisOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	return idempotency.New(store, idempotency.Options{})
}

// serve serves e over real HTTP until the test ends, and returns its URL.
func serve(t *testing.T, e *echo.Echo) string {
	hs := httptest.NewServer(e)
	t.Cleanup(hs.Close)
	return hs.URL
}

var byAccount = idempotency.MiddlewareOptions{
	Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil },
}

// TestRedisPanicAfterTheBodyBegan: on redis-server, a handler that panics
// once it has begun its body has its key released, whether
// middleware.Recover goes before the adapter (the client gets echo's 500)
// or after it (the client gets the begun body): the retry runs the handler
// again, and its answer is the one kept.
func TestRedisPanicAfterTheBodyBegan(t *testing.T) {
	srv := testserver.StartRedis(t)
	for _, c := range []struct {
		before bool
		status int
		body   string
	}{
		{true, http.StatusInternalServerError, `{"message":"Internal Server Error"}`},
		{false, http.StatusOK, "partial"},
	} {
		t.Run(fmt.Sprintf("recover before %t", c.before), func(t *testing.T) {
			var runs atomic.Int64
			guard := idempotencyecho.Middleware(redisGuard(t, srv), byAccount)
			e := newEcho()
			if c.before {
				e.POST("/v1/charges", panicky(&runs, true), recoverQuietly, guard)
			} else {
				e.POST("/v1/charges", panicky(&runs, true), guard, recoverQuietly)
			}
			url := serve(t, e)
			key := fmt.Sprint("panic-", c.before)

			first := sendTo(t, url, key, `{}`)
			assert.Equal(t, c.status, first.status)
			assert.Equal(t, c.body, strings.TrimSpace(first.body))
			assert.False(t, first.replayed)
			for i := range 2 {
				got := sendTo(t, url, key, `{}`)
				assert.Equal(t, http.StatusCreated, got.status)
				assert.JSONEq(t, `{"attempt":2,"takeover":true}`, got.body, "released: the retry ran")
				assert.Equal(t, i == 1, got.replayed)
			}
			assert.Equal(t, int64(2), runs.Load())
		})
	}
}

// TestRedisHistoryKept: on redis-server, an operation with history is
// never forgotten. Attempt 1 runs a Step and answers 503 (released);
// attempt 2 answers 409, which alone would forget the key but, after an
// attempt, releases it; attempt 3 answers 201. The step ran once, and the
// downstream key was the same on every attempt.
func TestRedisHistoryKept(t *testing.T) {
	srv := testserver.StartRedis(t)
	var steps atomic.Int64
	var mu sync.Mutex
	var keys []string
	var attempts []int
	e := newEcho()
	e.POST("/v1/charges", func(c echo.Context) error {
		ctx := c.Request().Context()
		info, _ := idempotency.FromContext(ctx)
		dk, err := idempotency.DownstreamKey(ctx, "gateway")
		require.NoError(t, err)
		mu.Lock()
		keys, attempts = append(keys, dk), append(attempts, info.Attempt)
		n := len(attempts)
		mu.Unlock()
		switch n {
		case 1:
			_, err := idempotency.Step(ctx, "charge", func(context.Context) (string, error) {
				return fmt.Sprint("rc_", steps.Add(1)), nil
			})
			require.NoError(t, err)
			return echo.NewHTTPError(http.StatusServiceUnavailable, "receipt not sent")
		case 2:
			return echo.NewHTTPError(http.StatusConflict, "account busy")
		}
		return c.JSON(http.StatusCreated, map[string]any{"attempt": info.Attempt})
	}, idempotencyecho.Middleware(redisGuard(t, srv), byAccount))
	url := serve(t, e)

	assert.Equal(t, http.StatusServiceUnavailable, sendTo(t, url, "order-1", `{"amount":1}`).status)
	assert.Equal(t, http.StatusConflict, sendTo(t, url, "order-1", `{"amount":1}`).status)
	third := sendTo(t, url, "order-1", `{"amount":1}`)
	assert.Equal(t, http.StatusCreated, third.status)
	assert.JSONEq(t, `{"attempt":3}`, third.body)
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, []int{1, 2, 3}, attempts)
	assert.Equal(t, int64(1), steps.Load(), "the step ran once")
	require.Len(t, keys, 3)
	assert.Equal(t, []string{keys[0], keys[0], keys[0]}, keys, "one downstream key")
}
