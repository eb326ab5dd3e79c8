package idempotencygin_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/gin-gonic/gin"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	idempotencygin "github.com/idempotency-go/idempotency/gin"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// answer is what a client read.
type answer struct {
	status   int
	header   http.Header
	body     string
	replayed bool
}

// send POSTs body with the key to url over real HTTP. It may run on a
// goroutine of its own: a failure is reported, and the answer is zero.
func send(t *testing.T, url, key, body string) answer {
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

// TestRedisEndToEnd: two instances, each a gin engine with its own Guard on
// one redis-server, run a charge once between them, however the client's
// attempts are spread: each answer is the one run's, byte for byte.
func TestRedisEndToEnd(t *testing.T) {
	srv := testserver.StartRedis(t)
	var runs atomic.Int64
	instance := func() string {
		store, err := idempotency.NewRedisStore(srv.Client(), idempotency.RedisOptions{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = store.Close() })
		r := newEngine()
		r.Use(gin.RecoveryWithWriter(io.Discard))
		r.POST("/v1/charges", idempotencygin.Middleware(idempotency.New(store, idempotency.Options{}), idempotency.MiddlewareOptions{
			Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil },
		}), createCharge(&runs))
		hs := httptest.NewServer(r)
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
		wg.Go(func() { answers[i] = send(t, url, "order-1842", `{"amount":4200}`) })
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

	reused := send(t, b, "order-1842", `{"amount":1}`)
	assert.Equal(t, http.StatusUnprocessableEntity, reused.status)
	assert.Equal(t, int64(1), runs.Load())
}

// redisGuard is a Guard of its own on srv, as one instance of a service.
func redisGuard(t *testing.T, srv *testserver.Redis) *idempotency.Guard {
	store, err := idempotency.NewRedisStore(srv.Client(), idempotency.RedisOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	return idempotency.New(store, idempotency.Options{})
}

// serve serves r over real HTTP until the test ends, and returns its URL.
func serve(t *testing.T, r *gin.Engine) string {
	hs := httptest.NewServer(r)
	t.Cleanup(hs.Close)
	return hs.URL
}

var byAccount = idempotency.MiddlewareOptions{
	Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil },
}

// TestRedisErrorRenderedBeforeTheAdapter: on redis-server, with the
// error renderer before the adapter, a handler that records an error and
// writes nothing gets the renderer's answer to the client, and the record
// is released, not completed: the retry runs the handler again as the same
// operation, and its answer is the one kept. A handler that writes a body
// and records an error has that body kept and replayed.
func TestRedisErrorRenderedBeforeTheAdapter(t *testing.T) {
	srv := testserver.StartRedis(t)
	var mu sync.Mutex
	var ops []string
	r := newEngine()
	r.Use(renderErrors)
	r.POST("/v1/charges", idempotencygin.Middleware(redisGuard(t, srv), byAccount), func(c *gin.Context) {
		info, _ := idempotency.FromContext(c)
		mu.Lock()
		ops = append(ops, info.OperationID)
		mu.Unlock()
		switch {
		case c.GetHeader(idempotency.HeaderKey) == "mail" && info.Attempt == 1:
			c.JSON(http.StatusCreated, gin.H{"id": "ch_mail"})
			_ = c.Error(errors.New("receipt mail failed"))
		case info.Attempt == 1:
			c.Status(http.StatusBadGateway)
			_ = c.Error(errors.New("gateway down"))
		default:
			c.JSON(http.StatusCreated, gin.H{"attempt": info.Attempt})
		}
	})
	url := serve(t, r)

	first := send(t, url, "order-1", `{"amount":1}`)
	assert.Equal(t, http.StatusBadGateway, first.status)
	assert.JSONEq(t, `{"error":"gateway down"}`, first.body)
	assert.False(t, first.replayed)
	for i := range 2 {
		got := send(t, url, "order-1", `{"amount":1}`)
		assert.Equal(t, http.StatusCreated, got.status)
		assert.JSONEq(t, `{"attempt":2}`, got.body, "released: the retry ran")
		assert.Equal(t, i == 1, got.replayed)
	}
	mu.Lock()
	if assert.Len(t, ops, 2) {
		assert.Equal(t, ops[0], ops[1], "one operation")
	}
	mu.Unlock()

	for i := range 2 {
		got := send(t, url, "mail", `{"amount":1}`)
		assert.Equal(t, http.StatusCreated, got.status)
		assert.JSONEq(t, `{"id":"ch_mail"}`, got.body)
		assert.Equal(t, i == 1, got.replayed)
	}
	mu.Lock()
	assert.Len(t, ops, 3, "the written answer was kept")
	mu.Unlock()
}

// TestRedisContextFallback: on redis-server, with ContextWithFallback the
// handler passes c as its context: SetDisposition(c, Release) releases a
// 201, and DownstreamKey(c, ...) is the same on the retry. An instance on
// the same store whose engine lacks the setting refuses loudly, runs
// nothing and forgets the record, so the key then runs as a new operation.
func TestRedisContextFallback(t *testing.T) {
	srv := testserver.StartRedis(t)
	var mu sync.Mutex
	var keys []string
	var attempts []int
	handler := func(c *gin.Context) {
		info, ok := idempotency.FromContext(c)
		require.True(t, ok)
		dk, err := idempotency.DownstreamKey(c, "gateway")
		require.NoError(t, err)
		mu.Lock()
		keys, attempts = append(keys, dk), append(attempts, info.Attempt)
		mu.Unlock()
		if info.Attempt == 1 {
			assert.True(t, idempotency.SetDisposition(c, idempotency.Release))
		}
		c.JSON(http.StatusCreated, gin.H{"attempt": info.Attempt})
	}
	misconfigured := gin.New()
	misconfigured.POST("/v1/charges", idempotencygin.Middleware(redisGuard(t, srv), byAccount), handler)
	configured := newEngine()
	configured.POST("/v1/charges", idempotencygin.Middleware(redisGuard(t, srv), byAccount), handler)
	a, b := serve(t, misconfigured), serve(t, configured)

	refused := send(t, a, "order-1", `{"amount":1}`)
	assert.Equal(t, http.StatusInternalServerError, refused.status)
	assert.Contains(t, refused.body, `"code":"context-without-fallback"`)
	assert.Contains(t, refused.body, "ContextWithFallback")
	mu.Lock()
	assert.Empty(t, keys, "no handler ran")
	mu.Unlock()

	assert.JSONEq(t, `{"attempt":1}`, send(t, b, "order-1", `{"amount":1}`).body, "forgotten: a new operation")
	assert.JSONEq(t, `{"attempt":2}`, send(t, b, "order-1", `{"amount":1}`).body, "released by SetDisposition(c, Release)")
	again := send(t, b, "order-1", `{"amount":1}`)
	assert.JSONEq(t, `{"attempt":2}`, again.body)
	assert.True(t, again.replayed)
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, []int{1, 2}, attempts)
	require.Len(t, keys, 2)
	assert.Equal(t, keys[0], keys[1], "one downstream key")
}

// TestRedisPanicAfterTheBodyBegan: on redis-server, a handler that panics
// once it has begun its body has its key released, whether gin.Recovery
// goes before the adapter or after it: the retry runs the handler again,
// and its answer is the one kept.
func TestRedisPanicAfterTheBodyBegan(t *testing.T) {
	srv := testserver.StartRedis(t)
	for _, before := range []bool{true, false} {
		t.Run(fmt.Sprintf("recovery before %t", before), func(t *testing.T) {
			var runs atomic.Int64
			recovery := gin.RecoveryWithWriter(io.Discard)
			guard := idempotencygin.Middleware(redisGuard(t, srv), byAccount)
			r := newEngine()
			if before {
				r.POST("/v1/charges", recovery, guard, panicky(&runs, true))
			} else {
				r.POST("/v1/charges", guard, recovery, panicky(&runs, true))
			}
			url := serve(t, r)
			key := fmt.Sprint("panic-", before)
			want := http.StatusOK // the begun body, which gin sends
			if before {
				want = http.StatusInternalServerError // gin.Recovery's, on gin's writer
			}
			assert.Equal(t, want, send(t, url, key, `{}`).status)
			for i := range 2 {
				got := send(t, url, key, `{}`)
				assert.Equal(t, http.StatusCreated, got.status)
				assert.JSONEq(t, `{"attempt":2,"takeover":true}`, got.body)
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
	r := newEngine()
	r.POST("/v1/charges", idempotencygin.Middleware(redisGuard(t, srv), byAccount), func(c *gin.Context) {
		info, _ := idempotency.FromContext(c)
		dk, err := idempotency.DownstreamKey(c, "gateway")
		require.NoError(t, err)
		mu.Lock()
		keys, attempts = append(keys, dk), append(attempts, info.Attempt)
		n := len(attempts)
		mu.Unlock()
		switch n {
		case 1:
			_, err := idempotency.Step(c, "charge", func(context.Context) (string, error) {
				return fmt.Sprint("rc_", steps.Add(1)), nil
			})
			require.NoError(t, err)
			c.JSON(http.StatusServiceUnavailable, gin.H{"error": "receipt not sent"})
		case 2:
			c.JSON(http.StatusConflict, gin.H{"error": "account busy"})
		default:
			c.JSON(http.StatusCreated, gin.H{"attempt": info.Attempt})
		}
	})
	url := serve(t, r)

	assert.Equal(t, http.StatusServiceUnavailable, send(t, url, "order-1", `{"amount":1}`).status)
	assert.Equal(t, http.StatusConflict, send(t, url, "order-1", `{"amount":1}`).status)
	third := send(t, url, "order-1", `{"amount":1}`)
	assert.Equal(t, http.StatusCreated, third.status)
	assert.JSONEq(t, `{"attempt":3}`, third.body)
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, []int{1, 2, 3}, attempts)
	assert.Equal(t, int64(1), steps.Load(), "the step ran once")
	require.Len(t, keys, 3)
	assert.Equal(t, []string{keys[0], keys[0], keys[0]}, keys, "one downstream key")
}
