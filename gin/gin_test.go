package idempotencygin_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	idempotencygin "github.com/idempotency-go/idempotency/gin"
)

func TestMain(m *testing.M) {
	gin.SetMode(gin.TestMode)
	os.Exit(m.Run())
}

func newGuard() *idempotency.Guard {
	return idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
}

// newEngine is a gin engine as the adapter needs it: with
// ContextWithFallback, so that c carries the attempt.
func newEngine() *gin.Engine {
	r := gin.New()
	r.ContextWithFallback = true
	return r
}

// charges is a gin engine whose POST /v1/charges runs handlers behind the
// adapter.
func charges(g *idempotency.Guard, o idempotency.MiddlewareOptions, handlers ...gin.HandlerFunc) *gin.Engine {
	r := newEngine()
	r.POST("/v1/charges", append([]gin.HandlerFunc{idempotencygin.Middleware(g, o)}, handlers...)...)
	return r
}

var singleTenant = idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant}

// post sends a JSON POST /v1/charges with the key, if any, to h.
func post(h http.Handler, key, body string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodPost, "/v1/charges", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set(idempotency.HeaderKey, key)
	}
	rr := httptest.NewRecorder()
	h.ServeHTTP(rr, req)
	return rr
}

// createCharge answers c.JSON 201, counting its runs.
func createCharge(runs *atomic.Int64) gin.HandlerFunc {
	return func(c *gin.Context) {
		var in struct{ Amount int }
		if err := c.ShouldBindJSON(&in); err != nil {
			c.AbortWithStatusJSON(http.StatusBadRequest, gin.H{"error": err.Error()})
			return
		}
		run := runs.Add(1)
		c.Header("X-Charge", fmt.Sprint("ch_", run))
		c.JSON(http.StatusCreated, gin.H{"id": fmt.Sprint("ch_", run), "amount": in.Amount})
	}
}

// TestReplayByteForByte: a retry gets the c.JSON answer of the one run,
// status, header fields and body, marked replayed; the handler after the
// adapter does not run again, and middleware before it sees the status
// sent.
func TestReplayByteForByte(t *testing.T) {
	var runs atomic.Int64
	var statuses []int
	r := newEngine()
	r.Use(func(c *gin.Context) {
		c.Next()
		statuses = append(statuses, c.Writer.Status())
	})
	r.POST("/v1/charges", idempotencygin.Middleware(newGuard(), singleTenant), createCharge(&runs))

	first := post(r, "k1", `{"amount":4200}`)
	require.Equal(t, http.StatusCreated, first.Code)
	assert.JSONEq(t, `{"id":"ch_1","amount":4200}`, first.Body.String())
	assert.Empty(t, first.Header().Get(idempotency.HeaderReplayed))

	again := post(r, "k1", `{ "amount": 4200 }`) // the same JSON, spelt otherwise
	assert.Equal(t, http.StatusCreated, again.Code)
	assert.Equal(t, first.Body.Bytes(), again.Body.Bytes())
	want := first.Header().Clone()
	want.Set(idempotency.HeaderReplayed, "true")
	assert.Equal(t, want, again.Header())
	assert.Equal(t, int64(1), runs.Load())
	assert.Equal(t, []int{http.StatusCreated, http.StatusCreated}, statuses)
}

// waitCounter is a store that counts the duplicates subscribing to wait for
// their original, and closes all once there are n.
type waitCounter struct {
	idempotency.Store
	n       int64
	waiting atomic.Int64
	all     chan struct{}
}

func (s *waitCounter) Subscribe(ctx context.Context, k idempotency.Key) (idempotency.Subscription, error) {
	if s.waiting.Add(1) == s.n {
		close(s.all)
	}
	return s.Store.Subscribe(ctx, k)
}

// TestDuplicatesWait: concurrent requests with one key run the handler
// once; every duplicate waits for it and gets its answer.
func TestDuplicatesWait(t *testing.T) {
	const n = 20
	store := &waitCounter{Store: idempotency.NewMemoryStore(idempotency.MemoryOptions{}), n: n - 1, all: make(chan struct{})}
	var runs atomic.Int64
	r := charges(idempotency.New(store, idempotency.Options{}), singleTenant, func(c *gin.Context) {
		select { // hold the original until every duplicate waits for it
		case <-store.all:
		case <-time.After(10 * time.Second):
		}
		c.Next()
	}, createCharge(&runs))

	answers := make([]*httptest.ResponseRecorder, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { answers[i] = post(r, "same", `{"amount":100}`) })
	}
	wg.Wait()
	assert.Equal(t, int64(1), runs.Load(), "handler runs")
	replayed := 0
	for _, a := range answers {
		assert.Equal(t, http.StatusCreated, a.Code)
		assert.JSONEq(t, `{"id":"ch_1","amount":100}`, a.Body.String())
		if a.Header().Get(idempotency.HeaderReplayed) == "true" {
			replayed++
		}
	}
	assert.Equal(t, n-1, replayed)
}

// TestKeyReused: the key sent again with another body gets 422, and the
// handler does not run.
func TestKeyReused(t *testing.T) {
	var runs atomic.Int64
	r := charges(newGuard(), singleTenant, createCharge(&runs))
	require.Equal(t, http.StatusCreated, post(r, "k1", `{"amount":100}`).Code)

	rr := post(r, "k1", `{"amount":999}`)
	assert.Equal(t, http.StatusUnprocessableEntity, rr.Code)
	assert.Equal(t, "application/problem+json", rr.Header().Get("Content-Type"))
	assert.Contains(t, rr.Body.String(), `"code":"key-reused"`)
	assert.Equal(t, int64(1), runs.Load())
}

// TestStripeErrors: with the StripeErrors profile, a reused key answers
// as Stripe's API does, and a missing key too.
func TestStripeErrors(t *testing.T) {
	var runs atomic.Int64
	r := charges(newGuard(), idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, Errors: idempotency.StripeErrors}, createCharge(&runs))
	require.Equal(t, http.StatusCreated, post(r, "k1", `{"amount":100}`).Code)

	for key, code := range map[string]string{"k1": "key-reused", "": "missing-key"} {
		rr := post(r, key, `{"amount":999}`)
		assert.Equal(t, http.StatusBadRequest, rr.Code)
		assert.Equal(t, "application/json", rr.Header().Get("Content-Type"))
		assert.Equal(t, "false", rr.Header().Get("Stripe-Should-Retry"))
		var body struct{ Error map[string]string }
		require.NoError(t, json.Unmarshal(rr.Body.Bytes(), &body), rr.Body.String())
		assert.Equal(t, "idempotency_error", body.Error["type"])
		assert.Equal(t, code, body.Error["code"])
	}
	assert.Equal(t, int64(1), runs.Load())
}

// TestAbortBeforeTheAdapter: a request that middleware before the adapter
// aborts claims nothing: the key stays free for the request that passes.
func TestAbortBeforeTheAdapter(t *testing.T) {
	var runs atomic.Int64
	r := newEngine()
	r.Use(func(c *gin.Context) {
		if c.GetHeader("Authorization") == "" {
			c.AbortWithStatusJSON(http.StatusUnauthorized, gin.H{"error": "unauthenticated"})
		}
	})
	r.POST("/v1/charges", idempotencygin.Middleware(newGuard(), singleTenant), createCharge(&runs))

	rr := post(r, "k1", `{"amount":100}`)
	assert.Equal(t, http.StatusUnauthorized, rr.Code)
	assert.JSONEq(t, `{"error":"unauthenticated"}`, rr.Body.String())

	req := httptest.NewRequest(http.MethodPost, "/v1/charges", strings.NewReader(`{"amount":200}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer t")
	req.Header.Set(idempotency.HeaderKey, "k1")
	rr = httptest.NewRecorder()
	r.ServeHTTP(rr, req)
	assert.Equal(t, http.StatusCreated, rr.Code)
	assert.JSONEq(t, `{"id":"ch_1","amount":200}`, rr.Body.String())
}

// TestAbortAfterTheAdapter: what middleware after the adapter answers when
// it aborts is the outcome. A 400 forgets the key, so the corrected
// request runs; a status set with AbortWithStatus, no body, is kept and
// replayed.
func TestAbortAfterTheAdapter(t *testing.T) {
	var runs atomic.Int64
	r := charges(newGuard(), singleTenant, func(c *gin.Context) {
		switch c.GetHeader("X-Test") {
		case "invalid":
			c.AbortWithStatusJSON(http.StatusBadRequest, gin.H{"error": "invalid"})
		case "payment-required":
			c.AbortWithStatus(http.StatusPaymentRequired)
		}
	}, createCharge(&runs))
	send := func(key, test string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/v1/charges", strings.NewReader(`{"amount":100}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(idempotency.HeaderKey, key)
		req.Header.Set("X-Test", test)
		rr := httptest.NewRecorder()
		r.ServeHTTP(rr, req)
		return rr
	}

	rr := send("k1", "invalid")
	assert.Equal(t, http.StatusBadRequest, rr.Code)
	assert.JSONEq(t, `{"error":"invalid"}`, rr.Body.String())
	assert.Equal(t, http.StatusCreated, send("k1", "").Code, "a 400 forgets the key")

	for range 2 {
		rr = send("k2", "payment-required")
		assert.Equal(t, http.StatusPaymentRequired, rr.Code)
		assert.Empty(t, rr.Body.String())
	}
	assert.Equal(t, "true", rr.Header().Get(idempotency.HeaderReplayed))
	assert.Equal(t, int64(1), runs.Load())
}

// TestStatusWithoutBody: a status the handler only sets (c.Status) is the
// stored status, as gin sends it once its handlers return.
func TestStatusWithoutBody(t *testing.T) {
	var runs atomic.Int64
	r := charges(newGuard(), singleTenant, func(c *gin.Context) {
		runs.Add(1)
		c.Status(http.StatusAccepted)
	})
	for range 2 {
		assert.Equal(t, http.StatusAccepted, post(r, "k1", `{}`).Code)
	}
	assert.Equal(t, int64(1), runs.Load())
}

// TestWriter: c.Writer of a guarded handler reports what gin's own writer
// would, and sends nothing before the outcome is stored.
func TestWriter(t *testing.T) {
	r := charges(newGuard(), singleTenant, func(c *gin.Context) {
		assert.Equal(t, http.StatusOK, c.Writer.Status())
		c.Status(http.StatusAccepted)
		assert.Equal(t, http.StatusAccepted, c.Writer.Status())
		assert.False(t, c.Writer.Written())
		assert.Equal(t, -1, c.Writer.Size())
		c.Writer.Flush() // writes the status, sends nothing
		assert.True(t, c.Writer.Written())
		c.Status(http.StatusCreated) // too late, as with gin's own writer
		n, err := c.Writer.WriteString("queued")
		assert.NoError(t, err)
		assert.Equal(t, 6, n)
		assert.Equal(t, http.StatusAccepted, c.Writer.Status())
		assert.Equal(t, 6, c.Writer.Size())
		_, _, err = c.Writer.Hijack()
		assert.Error(t, err)
		assert.Nil(t, c.Writer.Pusher())
	})
	rr := post(r, "k1", `{}`)
	assert.Equal(t, http.StatusAccepted, rr.Code)
	assert.Equal(t, "queued", rr.Body.String())
	assert.False(t, rr.Flushed)
}

// TestHandlerErrors: a handler that aborts with a 5xx releases the key, and
// one that aborts with a refusal forgets it: either way a retry runs the
// handler again, the former as the same operation.
func TestHandlerErrors(t *testing.T) {
	for _, status := range []int{http.StatusInternalServerError, http.StatusServiceUnavailable, http.StatusConflict} {
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			var runs atomic.Int64
			var ops []string
			r := charges(newGuard(), singleTenant, func(c *gin.Context) {
				info, _ := idempotency.FromContext(c.Request.Context())
				ops = append(ops, info.OperationID)
				if runs.Add(1) == 1 {
					_ = c.AbortWithError(status, errors.New("gateway down"))
					return
				}
				c.JSON(http.StatusCreated, gin.H{"attempt": info.Attempt})
			})
			assert.Equal(t, status, post(r, "k1", `{}`).Code)
			rr := post(r, "k1", `{}`)
			assert.Equal(t, http.StatusCreated, rr.Code)
			require.Len(t, ops, 2, "the retry ran the handler")
			if status >= 500 {
				assert.JSONEq(t, `{"attempt":2}`, rr.Body.String(), "released")
				assert.Equal(t, ops[0], ops[1])
			} else {
				assert.JSONEq(t, `{"attempt":1}`, rr.Body.String(), "forgotten")
				assert.NotEqual(t, ops[0], ops[1])
			}
		})
	}
}

// TestErrorsRenderedAfterTheAdapter: middleware after the adapter that
// turns c.Errors into an answer makes that answer the outcome: a 503
// releases the key.
func TestErrorsRenderedAfterTheAdapter(t *testing.T) {
	var runs atomic.Int64
	renderErrors := func(c *gin.Context) {
		c.Next()
		if err := c.Errors.Last(); err != nil && !c.Writer.Written() {
			c.JSON(http.StatusServiceUnavailable, gin.H{"error": err.Error()})
		}
	}
	r := charges(newGuard(), singleTenant, renderErrors, func(c *gin.Context) {
		if runs.Add(1) == 1 {
			_ = c.Error(errors.New("gateway down"))
			return
		}
		c.JSON(http.StatusCreated, gin.H{"id": "ch_1"})
	})
	rr := post(r, "k1", `{}`)
	assert.Equal(t, http.StatusServiceUnavailable, rr.Code)
	assert.JSONEq(t, `{"error":"gateway down"}`, rr.Body.String())
	assert.Equal(t, http.StatusCreated, post(r, "k1", `{}`).Code)
	assert.Equal(t, int64(2), runs.Load())
}

// renderErrors is error-rendering middleware as gin apps write it: once
// the handlers return, it answers the last error they recorded, if they
// wrote nothing, with the status they set when it is an error's, else 500.
func renderErrors(c *gin.Context) {
	c.Next()
	if err := c.Errors.Last(); err != nil && !c.Writer.Written() {
		status := c.Writer.Status()
		if status < http.StatusBadRequest {
			status = http.StatusInternalServerError
		}
		c.JSON(status, gin.H{"error": err.Error()})
	}
}

// TestErrorsRenderedBeforeTheAdapter: with the renderer before the adapter,
// the layout most gin apps have, handlers that record an error and write
// nothing have their key released, and the renderer's answer, with the
// status and header fields they set, reaches the client: not an empty 200,
// and nothing stored, so the retry runs the handler again as the same
// operation. Without a renderer, gin sends what it would without the
// adapter, the status set and no body, and the key is released all the
// same. Handlers that write a response and record an error are answered
// with what they wrote, kept and replayed; the renderer finds it sent.
func TestErrorsRenderedBeforeTheAdapter(t *testing.T) {
	for _, c := range []struct {
		name     string
		renderer bool
		fail     func(c *gin.Context)
		status   int
		body     string
	}{
		{"error", true, func(c *gin.Context) { _ = c.Error(errors.New("gateway down")) },
			http.StatusInternalServerError, `{"error":"gateway down"}`},
		{"status and error", true, func(c *gin.Context) {
			c.Status(http.StatusPaymentRequired) // kept, were it written
			_ = c.Error(errors.New("card declined"))
		}, http.StatusPaymentRequired, `{"error":"card declined"}`},
		{"no renderer", false, func(c *gin.Context) { _ = c.Error(errors.New("gateway down")) },
			http.StatusOK, ``},
	} {
		t.Run(c.name, func(t *testing.T) {
			var ops []string
			r := newEngine()
			if c.renderer {
				r.Use(renderErrors)
			}
			r.POST("/v1/charges", idempotencygin.Middleware(newGuard(), singleTenant), func(gc *gin.Context) {
				info, _ := idempotency.FromContext(gc)
				ops = append(ops, info.OperationID)
				if len(ops) == 1 {
					gc.Header("X-Charge", "ch_1")
					c.fail(gc)
					return
				}
				gc.JSON(http.StatusCreated, gin.H{"attempt": info.Attempt})
			})

			rr := post(r, "k1", `{}`)
			assert.Equal(t, c.status, rr.Code)
			if c.body == "" {
				assert.Empty(t, rr.Body.String())
			} else {
				assert.JSONEq(t, c.body, rr.Body.String())
			}
			assert.Equal(t, "ch_1", rr.Header().Get("X-Charge"), "the handler's header fields")
			assert.Empty(t, rr.Header().Get(idempotency.HeaderReplayed))

			for i := range 2 {
				rr = post(r, "k1", `{}`)
				assert.Equal(t, http.StatusCreated, rr.Code)
				assert.JSONEq(t, `{"attempt":2}`, rr.Body.String(), "released")
				assert.Equal(t, i == 1, rr.Header().Get(idempotency.HeaderReplayed) == "true")
			}
			require.Len(t, ops, 2, "the retry ran the handler")
			assert.Equal(t, ops[0], ops[1])
		})
	}

	t.Run("written and error", func(t *testing.T) {
		var runs atomic.Int64
		r := newEngine()
		r.Use(renderErrors)
		r.POST("/v1/charges", idempotencygin.Middleware(newGuard(), singleTenant), func(c *gin.Context) {
			runs.Add(1)
			c.JSON(http.StatusCreated, gin.H{"id": "ch_1"})
			_ = c.Error(errors.New("receipt mail failed"))
		})
		for i := range 2 {
			rr := post(r, "k1", `{}`)
			assert.Equal(t, http.StatusCreated, rr.Code)
			assert.JSONEq(t, `{"id":"ch_1"}`, rr.Body.String())
			assert.Equal(t, i == 1, rr.Header().Get(idempotency.HeaderReplayed) == "true")
		}
		assert.Equal(t, int64(1), runs.Load(), "kept")
	})
}

// panicky panics on its first run, after writing part of its answer when
// partial is set; then it answers its attempt.
func panicky(runs *atomic.Int64, partial bool) gin.HandlerFunc {
	return func(c *gin.Context) {
		if runs.Add(1) == 1 {
			if partial {
				c.String(http.StatusOK, "partial")
			}
			panic("boom")
		}
		info, _ := idempotency.FromContext(c.Request.Context())
		c.JSON(http.StatusCreated, gin.H{"attempt": info.Attempt, "takeover": info.Takeover})
	}
}

// TestPanicReleases: a panicking handler's key is released, never stored:
// the retry runs the handler again, as a takeover, and its answer is the
// one replayed. gin.Recovery before the adapter gets the panic and answers
// 500. After it, it answers 500 inside the guard, or, once the handler has
// begun its body, lets gin send that, as gin alone would.
func TestPanicReleases(t *testing.T) {
	for _, c := range []struct {
		before, partial bool
		status          int
		body            string
	}{
		{true, false, http.StatusInternalServerError, ""},
		{true, true, http.StatusInternalServerError, ""},
		{false, false, http.StatusInternalServerError, ""},
		{false, true, http.StatusOK, "partial"},
	} {
		t.Run(fmt.Sprintf("recovery before %t partial %t", c.before, c.partial), func(t *testing.T) {
			var runs atomic.Int64
			recovery := gin.RecoveryWithWriter(io.Discard)
			guard := idempotencygin.Middleware(newGuard(), singleTenant)
			r := newEngine()
			if c.before {
				r.POST("/v1/charges", recovery, guard, panicky(&runs, c.partial))
			} else {
				r.POST("/v1/charges", guard, recovery, panicky(&runs, c.partial))
			}
			rr := post(r, "k1", `{}`)
			assert.Equal(t, c.status, rr.Code)
			assert.Equal(t, c.body, rr.Body.String())
			assert.Empty(t, rr.Header().Get(idempotency.HeaderReplayed))

			for range 2 {
				rr = post(r, "k1", `{}`)
				assert.Equal(t, http.StatusCreated, rr.Code)
				assert.JSONEq(t, `{"attempt":2,"takeover":true}`, rr.Body.String())
			}
			assert.Equal(t, "true", rr.Header().Get(idempotency.HeaderReplayed))
			assert.Equal(t, int64(2), runs.Load())
		})
	}
}

// TestPanicWithoutRecovery: without gin.Recovery the panic goes on to
// net/http, which drops the connection; the key is released, so the
// retry runs the handler.
func TestPanicWithoutRecovery(t *testing.T) {
	var runs atomic.Int64
	srv := httptest.NewUnstartedServer(charges(newGuard(), singleTenant, panicky(&runs, true)))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.Start()
	t.Cleanup(srv.Close)
	send := func() (*http.Response, error) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/charges", strings.NewReader(`{}`))
		require.NoError(t, err)
		req.Header.Set(idempotency.HeaderKey, "k1")
		return srv.Client().Do(req)
	}
	_, err := send()
	require.Error(t, err, "net/http drops the connection of a handler that panicked")

	res, err := send()
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	assert.Equal(t, http.StatusCreated, res.StatusCode)
	assert.JSONEq(t, `{"attempt":2,"takeover":true}`, string(b))
	assert.Equal(t, int64(2), runs.Load())
}

// TestResponseOverMaxResponseBytes: a body over MaxResponseBytes reaches
// the client whole; the retry gets its status and header fields without
// it, marked as omitted, and the handler runs once.
func TestResponseOverMaxResponseBytes(t *testing.T) {
	var runs atomic.Int64
	body := strings.Repeat("0123456789", 10)
	r := charges(newGuard(), idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, MaxResponseBytes: 16}, func(c *gin.Context) {
		runs.Add(1)
		c.Data(http.StatusCreated, "text/csv", []byte(body))
	})
	rr := post(r, "k1", `{}`)
	assert.Equal(t, http.StatusCreated, rr.Code)
	assert.Equal(t, body, rr.Body.String())

	rr = post(r, "k1", `{}`)
	assert.Equal(t, http.StatusCreated, rr.Code)
	assert.Empty(t, rr.Body.String())
	assert.Equal(t, "text/csv", rr.Header().Get("Content-Type"))
	assert.Equal(t, "too-large", rr.Header().Get(idempotency.HeaderBodyOmitted))
	assert.Equal(t, "true", rr.Header().Get(idempotency.HeaderReplayed))
	assert.Equal(t, int64(1), runs.Load())
}

// TestOperationInHandler: c.Request.Context() carries the attempt, and so
// does c itself: FromContext, DownstreamKey, Step and SetDisposition work
// in either, and c.Done() is the attempt's. A retry after a release
// resumes after the recorded step with the same downstream key.
func TestOperationInHandler(t *testing.T) {
	var steps atomic.Int64
	type seen struct {
		op, downstream, onC string
		attempt             int
		receipt             string
	}
	var runs []seen
	handler := func(c *gin.Context) {
		ctx := c.Request.Context()
		info, ok := idempotency.FromContext(ctx)
		require.True(t, ok)
		onC, ok := idempotency.FromContext(c)
		require.True(t, ok, "c carries the attempt")
		assert.Same(t, info, onC)
		assert.NotNil(t, c.Done())
		assert.Equal(t, ctx.Done(), c.Done())
		dk, err := idempotency.DownstreamKey(ctx, "gateway")
		require.NoError(t, err)
		dkOnC, err := idempotency.DownstreamKey(c, "gateway")
		require.NoError(t, err)
		receipt, err := idempotency.Step(c, "charge", func(context.Context) (string, error) {
			return fmt.Sprint("rc_", steps.Add(1)), nil
		})
		require.NoError(t, err)
		runs = append(runs, seen{info.OperationID, dk, dkOnC, info.Attempt, receipt})
		if len(runs) == 1 {
			// The receipt could not be sent: released, though the status
			// alone would keep it.
			assert.True(t, idempotency.SetDisposition(c, idempotency.Release))
		}
		c.JSON(http.StatusCreated, gin.H{"receipt": receipt, "attempt": info.Attempt})
	}
	r := charges(newGuard(), singleTenant, handler)
	assert.JSONEq(t, `{"receipt":"rc_1","attempt":1}`, post(r, "k1", `{}`).Body.String())
	assert.JSONEq(t, `{"receipt":"rc_1","attempt":2}`, post(r, "k1", `{}`).Body.String(), "released")
	again := post(r, "k1", `{}`)
	assert.JSONEq(t, `{"receipt":"rc_1","attempt":2}`, again.Body.String())
	assert.Equal(t, "true", again.Header().Get(idempotency.HeaderReplayed))

	require.Len(t, runs, 2)
	assert.Equal(t, int64(1), steps.Load(), "the step ran once")
	assert.Equal(t, []int{1, 2}, []int{runs[0].attempt, runs[1].attempt})
	assert.Equal(t, runs[0].op, runs[1].op)
	assert.Equal(t, runs[0].downstream, runs[1].downstream)
	assert.Equal(t, runs[0].downstream, runs[0].onC)
	assert.Equal(t, runs[1].downstream, runs[1].onC)
	assert.Equal(t, "rc_1", runs[1].receipt)
}

// TestContextWithoutFallback: on an engine without ContextWithFallback, c
// would carry no attempt, so a guarded request is refused out loud: a 500
// problem naming the setting, ErrContextWithoutFallback in c.Errors for
// the middleware before the adapter, and no handler after it runs. The
// record is forgotten: once the engine sets it, the key runs as a new
// operation. Requests that are not guarded pass through.
func TestContextWithoutFallback(t *testing.T) {
	var runs atomic.Int64
	var recorded []error
	r := gin.New()
	r.Use(func(c *gin.Context) {
		c.Next()
		for _, e := range c.Errors {
			recorded = append(recorded, e.Err)
		}
	})
	handler := func(c *gin.Context) {
		info, _ := idempotency.FromContext(c)
		runs.Add(1)
		c.JSON(http.StatusCreated, gin.H{"attempt": info.Attempt})
	}
	r.POST("/v1/charges", idempotencygin.Middleware(newGuard(), singleTenant), handler)
	r.GET("/v1/charges", idempotencygin.Middleware(newGuard(), singleTenant), func(c *gin.Context) {
		runs.Add(1)
		c.String(http.StatusOK, "listed")
	})

	for range 2 {
		rr := post(r, "k1", `{}`)
		assert.Equal(t, http.StatusInternalServerError, rr.Code)
		assert.Equal(t, "application/problem+json", rr.Header().Get("Content-Type"))
		assert.Equal(t, "no-store", rr.Header().Get("Cache-Control"))
		var p idempotency.Problem
		require.NoError(t, json.Unmarshal(rr.Body.Bytes(), &p), rr.Body.String())
		assert.Equal(t, "context-without-fallback", p.Code)
		assert.Equal(t, idempotency.ProblemTypes+"context-without-fallback", p.Type)
		assert.Contains(t, p.Detail, "ContextWithFallback")
		assert.Empty(t, rr.Header().Get(idempotency.HeaderReplayed))
	}
	assert.Equal(t, int64(0), runs.Load(), "no handler ran")
	require.Len(t, recorded, 2)
	for _, err := range recorded {
		assert.ErrorIs(t, err, idempotencygin.ErrContextWithoutFallback)
		assert.Contains(t, err.Error(), "ContextWithFallback = true")
	}

	req := httptest.NewRequest(http.MethodGet, "/v1/charges", nil)
	req.Header.Set(idempotency.HeaderKey, "k1")
	rr := httptest.NewRecorder()
	r.ServeHTTP(rr, req)
	assert.Equal(t, "listed", rr.Body.String(), "a GET is not guarded")

	r.ContextWithFallback = true
	rr = post(r, "k1", `{}`)
	assert.Equal(t, http.StatusCreated, rr.Code)
	assert.JSONEq(t, `{"attempt":1}`, rr.Body.String(), "forgotten: a new operation")
}

// TestPassThrough: a method that is not guarded reaches the handler with
// the request and writer gin had, every time; a guarded one without a key
// is refused, and the handler does not run.
func TestPassThrough(t *testing.T) {
	var runs atomic.Int64
	var outer struct {
		req *http.Request
		w   gin.ResponseWriter
	}
	r := newEngine()
	r.Use(func(c *gin.Context) { outer.req, outer.w = c.Request, c.Writer }, idempotencygin.Middleware(newGuard(), singleTenant))
	handler := func(c *gin.Context) {
		runs.Add(1)
		assert.Same(t, outer.req, c.Request)
		assert.Same(t, outer.w, c.Writer)
		c.String(http.StatusOK, "balance")
	}
	r.GET("/v1/balance", handler)
	r.POST("/v1/charges", handler)

	for range 2 {
		req := httptest.NewRequest(http.MethodGet, "/v1/balance", nil)
		req.Header.Set(idempotency.HeaderKey, "k1")
		rr := httptest.NewRecorder()
		r.ServeHTTP(rr, req)
		assert.Equal(t, http.StatusOK, rr.Code)
		assert.Empty(t, rr.Header().Get(idempotency.HeaderReplayed))
	}
	assert.Equal(t, int64(2), runs.Load())

	rr := post(r, "", `{}`)
	assert.Equal(t, http.StatusBadRequest, rr.Code)
	assert.Contains(t, rr.Body.String(), `"code":"missing-key"`)
	assert.Equal(t, int64(2), runs.Load())
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

// TestRoute: the Guard's events name gin's route pattern.
func TestRoute(t *testing.T) {
	obs := &routes{}
	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{Observer: obs})
	r := newEngine()
	r.POST("/v1/charges/:id/capture", idempotencygin.Middleware(g, singleTenant), func(c *gin.Context) {
		c.String(http.StatusOK, c.Param("id"))
	})
	req := httptest.NewRequest(http.MethodPost, "/v1/charges/ch_1/capture", nil)
	req.Header.Set(idempotency.HeaderKey, "k1")
	rr := httptest.NewRecorder()
	r.ServeHTTP(rr, req)
	assert.Equal(t, "ch_1", rr.Body.String())
	assert.Equal(t, []string{"/v1/charges/:id/capture"}, obs.seen)
}

// TestCompletedOutside: a handler that completes the key in its own
// transaction, as postgres.Store.CompleteTx does, and writes nothing is
// answered with what it completed, and so is every retry.
func TestCompletedOutside(t *testing.T) {
	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	var runs atomic.Int64
	r := charges(idempotency.New(store, idempotency.Options{}), singleTenant, func(c *gin.Context) {
		runs.Add(1)
		ctx := c.Request.Context()
		resp := idempotency.Response{Status: http.StatusCreated, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"id":"ch_1"}`)}
		err := idempotency.CompleteOutside(ctx, store, resp, func(k idempotency.Key, token uint64, retention time.Duration) error {
			return store.Complete(ctx, k, token, resp, retention) // the transaction's commit
		})
		assert.NoError(t, err)
	})
	for i := range 2 {
		rr := post(r, "k1", `{}`)
		assert.Equal(t, http.StatusCreated, rr.Code)
		assert.Equal(t, "application/json", rr.Header().Get("Content-Type"))
		assert.Equal(t, `{"id":"ch_1"}`, rr.Body.String())
		assert.Equal(t, i == 1, rr.Header().Get(idempotency.HeaderReplayed) == "true")
	}
	assert.Equal(t, int64(1), runs.Load())
}

// TestNoRoute: on r.Use, the adapter runs for a request that matches no
// route too; gin's 404 is its answer, kept and replayed.
func TestNoRoute(t *testing.T) {
	r := newEngine()
	r.Use(idempotencygin.Middleware(newGuard(), singleTenant))
	r.POST("/v1/charges", func(c *gin.Context) { c.Status(http.StatusCreated) })
	for i := range 2 {
		req := httptest.NewRequest(http.MethodPost, "/v1/nowhere", nil)
		req.Header.Set(idempotency.HeaderKey, "k1")
		rr := httptest.NewRecorder()
		r.ServeHTTP(rr, req)
		assert.Equal(t, http.StatusNotFound, rr.Code)
		assert.Equal(t, i == 1, rr.Header().Get(idempotency.HeaderReplayed) == "true")
	}
}
