package frameworks_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
)

// chiCharges is a chi router whose POST /v1/charges runs handler behind the
// middleware, mounted with Use.
func chiCharges(g *idempotency.Guard, o idempotency.MiddlewareOptions, handler http.HandlerFunc) *chi.Mux {
	r := chi.NewRouter()
	r.Use(middleware.Recoverer, g.Middleware(o))
	r.Post("/v1/charges", handler)
	return r
}

// chiCharge answers JSON 201, counting its runs.
func chiCharge(runs *atomic.Int64) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		run := runs.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Charge", fmt.Sprint("ch_", run))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"ch_%d"}`, run)
	}
}

// TestChiReplay: a retry gets the answer of the one run, byte for byte,
// marked replayed.
func TestChiReplay(t *testing.T) {
	var runs atomic.Int64
	r := chiCharges(newGuard(), singleTenant, chiCharge(&runs))
	first := post(r, "/v1/charges", "k1", `{"amount":1}`)
	require.Equal(t, http.StatusCreated, first.Code)

	again := post(r, "/v1/charges", "k1", `{"amount":1}`)
	assert.Equal(t, http.StatusCreated, again.Code)
	assert.Equal(t, first.Body.Bytes(), again.Body.Bytes())
	want := first.Header().Clone()
	want.Set(idempotency.HeaderReplayed, "true")
	assert.Equal(t, want, again.Header())
	assert.Equal(t, int64(1), runs.Load())
}

// TestChiDuplicatesWait: concurrent requests with one key run the handler
// once; every duplicate waits for it and gets its answer.
func TestChiDuplicatesWait(t *testing.T) {
	const n = 20
	store := newWaitCounter(n - 1)
	var runs atomic.Int64
	charge := chiCharge(&runs)
	r := chi.NewRouter()
	r.With(idempotency.New(store, idempotency.Options{}).Middleware(singleTenant)).Post("/v1/charges", func(w http.ResponseWriter, r *http.Request) {
		select { // hold the original until every duplicate waits for it
		case <-store.all:
		case <-time.After(10 * time.Second):
		}
		charge(w, r)
	})
	answers := concurrently(n, func() *httptest.ResponseRecorder { return post(r, "/v1/charges", "same", `{}`) })
	assert.Equal(t, int64(1), runs.Load(), "handler runs")
	replayed := 0
	for _, a := range answers {
		assert.Equal(t, http.StatusCreated, a.Code)
		assert.Equal(t, `{"id":"ch_1"}`, a.Body.String())
		if a.Header().Get(idempotency.HeaderReplayed) == "true" {
			replayed++
		}
	}
	assert.Equal(t, n-1, replayed)
}

// TestChiKeyReused: the key sent again with another body gets 422, and the
// handler does not run.
func TestChiKeyReused(t *testing.T) {
	var runs atomic.Int64
	r := chiCharges(newGuard(), singleTenant, chiCharge(&runs))
	require.Equal(t, http.StatusCreated, post(r, "/v1/charges", "k1", `{"amount":1}`).Code)
	rr := post(r, "/v1/charges", "k1", `{"amount":2}`)
	assert.Equal(t, http.StatusUnprocessableEntity, rr.Code)
	assert.Contains(t, rr.Body.String(), `"code":"key-reused"`)
	assert.Equal(t, int64(1), runs.Load())
}

// TestChiFailures: a 5xx releases the key, and so does a panic, which goes
// on to middleware.Recoverer before the guard and is answered 500; the
// retry runs again as the same operation.
func TestChiFailures(t *testing.T) {
	for _, fail := range []string{"status", "panic"} {
		t.Run(fail, func(t *testing.T) {
			var runs atomic.Int64
			var ops []string
			r := chiCharges(newGuard(), singleTenant, func(w http.ResponseWriter, r *http.Request) {
				info, _ := idempotency.FromContext(r.Context())
				ops = append(ops, info.OperationID)
				if runs.Add(1) == 1 {
					if fail == "panic" {
						panic("boom")
					}
					http.Error(w, "gateway down", http.StatusBadGateway)
					return
				}
				fmt.Fprintf(w, "attempt %d", info.Attempt)
			})
			rr := post(r, "/v1/charges", "k1", `{}`)
			assert.Equal(t, map[string]int{"status": 502, "panic": 500}[fail], rr.Code)
			rr = post(r, "/v1/charges", "k1", `{}`)
			assert.Equal(t, http.StatusOK, rr.Code)
			assert.Equal(t, "attempt 2", rr.Body.String())
			require.Len(t, ops, 2)
			assert.Equal(t, ops[0], ops[1])
		})
	}
}

// TestChiUseAndWith: the handler gets the attempt and its URL parameters
// either way. With runs after routing: the Guard's events carry the route
// pattern, and only the routes it is given are guarded. Use runs before
// routing: no pattern yet, and a POST to no route is guarded too, its 404
// kept.
func TestChiUseAndWith(t *testing.T) {
	for _, with := range []bool{true, false} {
		t.Run(fmt.Sprintf("with %t", with), func(t *testing.T) {
			obs := &routes{}
			guarded := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{Observer: obs}).Middleware(singleTenant)
			capture := func(w http.ResponseWriter, r *http.Request) {
				dk, err := idempotency.DownstreamKey(r.Context(), "gateway")
				if err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				fmt.Fprintf(w, "%s %t", chi.URLParam(r, "id"), len(dk) > 0)
			}
			r := chi.NewRouter()
			if with {
				r.With(guarded).Post("/v1/charges/{id}/capture", capture)
			} else {
				r.Use(guarded)
				r.Post("/v1/charges/{id}/capture", capture)
			}
			rr := post(r, "/v1/charges/ch_1/capture", "k1", `{}`)
			assert.Equal(t, http.StatusOK, rr.Code)
			assert.Equal(t, "ch_1 true", rr.Body.String())
			for range 2 {
				rr = post(r, "/v1/nowhere", "k2", `{}`)
				assert.Equal(t, http.StatusNotFound, rr.Code)
			}
			if with {
				assert.Equal(t, []string{"/v1/charges/{id}/capture"}, obs.seen)
				assert.Empty(t, rr.Header().Get(idempotency.HeaderReplayed))
			} else {
				assert.Equal(t, []string{"", "", ""}, obs.seen)
				assert.Equal(t, "true", rr.Header().Get(idempotency.HeaderReplayed))
			}
		})
	}
}
