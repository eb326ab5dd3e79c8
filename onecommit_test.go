package idempotency_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// transactor is a Transactor in memory, for the Guard's side of the
// one-commit mode: a key's outcome is kept only when op keeps it, as a
// store's commit would; a key is never in flight (calls are serialised).
type transactor struct {
	*idempotency.MemoryStore
	mu   sync.Mutex
	done map[idempotency.Key]idempotency.Response
	fps  map[idempotency.Key]idempotency.Fingerprint
	ops  map[idempotency.Key]string
}

func newTransactor() *transactor {
	return &transactor{MemoryStore: idempotency.NewMemoryStore(idempotency.MemoryOptions{}),
		done: map[idempotency.Key]idempotency.Response{}, fps: map[idempotency.Key]idempotency.Fingerprint{},
		ops: map[idempotency.Key]string{}}
}

func (s *transactor) Transact(ctx context.Context, req idempotency.ClaimRequest, _ time.Duration,
	op func(ctx context.Context, c idempotency.Claim) (idempotency.Response, bool, error)) (idempotency.Claim, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if resp, ok := s.done[req.Key]; ok {
		if s.fps[req.Key] != req.Fingerprint {
			return idempotency.Claim{State: idempotency.Mismatch}, nil
		}
		return idempotency.Claim{State: idempotency.Completed, Response: resp, OperationID: s.ops[req.Key]}, nil
	}
	c := idempotency.Claim{State: idempotency.Owner, OperationID: req.OperationID, Attempt: 1, Token: 7}
	resp, keep, err := op(ctx, c)
	if err == nil && keep {
		s.done[req.Key], s.fps[req.Key], s.ops[req.Key] = resp, req.Fingerprint, req.OperationID
	}
	return c, err
}

// A Guard on a Transactor runs the operation through it: a kept outcome is
// replayed, a released one is not stored, an error is returned as it is,
// and another request under the key is a mismatch.
func TestOneCommitGuard(t *testing.T) {
	s := newTransactor()
	g := idempotency.New(s, idempotency.Options{})
	k := idempotency.Key{Name: "k"}
	fp := idempotency.FingerprintOf("t", []byte("a"))
	runs := 0
	op := func(ctx context.Context) (idempotency.Response, error) {
		runs++
		info, ok := idempotency.FromContext(ctx)
		require.True(t, ok)
		assert.Equal(t, 1, info.Attempt)
		assert.Equal(t, uint64(7), info.Token)
		return idempotency.Response{Status: 201, Body: []byte(info.OperationID)}, nil
	}
	failure := errors.New("failed")
	_, err := g.Do(t.Context(), k, fp, func(context.Context) (idempotency.Response, error) { return idempotency.Response{}, failure })
	require.ErrorIs(t, err, failure)
	res, err := g.Do(t.Context(), k, fp, func(ctx context.Context) (idempotency.Response, error) {
		idempotency.SetDisposition(ctx, idempotency.Release)
		return op(ctx)
	})
	require.NoError(t, err)
	assert.False(t, res.Replayed)
	first, err := g.Do(t.Context(), k, fp, op)
	require.NoError(t, err)
	assert.False(t, first.Replayed, "a released outcome was not stored")
	again, err := g.Do(t.Context(), k, fp, op)
	require.NoError(t, err)
	assert.True(t, again.Replayed)
	assert.Equal(t, first.Response.Body, again.Response.Body)
	assert.Equal(t, first.OperationID, again.OperationID)
	assert.Equal(t, 2, runs)
	_, err = g.Do(t.Context(), k, idempotency.FingerprintOf("t", []byte("b")), op)
	require.ErrorIs(t, err, idempotency.ErrMismatch)
	assert.Panics(t, func() {
		_, _ = g.Do(t.Context(), idempotency.Key{Name: "p"}, fp, func(context.Context) (idempotency.Response, error) { panic("boom") })
	})
}

// Inside a one-commit operation nothing needs an owner: a step is a plain
// call, the calls that need a lease fail, and a response too large to
// buffer cannot be streamed before the commit (503, nothing stored).
func TestOneCommitOwnerless(t *testing.T) {
	s := newTransactor()
	g := idempotency.New(s, idempotency.Options{})
	_, err := g.Do(t.Context(), idempotency.Key{Name: "k"}, idempotency.Fingerprint{}, func(ctx context.Context) (idempotency.Response, error) {
		for want := 1; want <= 2; want++ {
			n := 0
			v, err := idempotency.Step(ctx, "s", func(context.Context) (int, error) { n++; return want, nil })
			require.NoError(t, err)
			assert.Equal(t, want, v)
			assert.Equal(t, 1, n)
		}
		info, _ := idempotency.FromContext(ctx)
		_, err := info.RecoveryPoints(ctx)
		assert.ErrorIs(t, err, idempotency.ErrNoRecoveryPoints)
		assert.Error(t, idempotency.CompleteOutside(ctx, s, idempotency.Response{}, func(idempotency.Key, uint64, time.Duration) error {
			t.Error("CompleteOutside called its function")
			return nil
		}))
		return idempotency.Response{Status: 200}, nil
	})
	require.NoError(t, err)

	h := g.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, MaxResponseBytes: 4})(
		http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("far too long")) }))
	r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader("{}"))
	r.Header.Set(idempotency.HeaderKey, "big")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	assert.Equal(t, http.StatusServiceUnavailable, w.Code, w.Body.String())
	assert.Empty(t, s.done[idempotency.Key{Name: "big"}], "nothing stored")
}

// The middleware's rules that judge a claim hold in the one-commit mode
// too: a key older than the retention with no record is refused (400
// key-expired, nothing run, nothing kept), and a retry whose record was made
// under OtherFingerprintHeaders replays.
func TestOneCommitMiddlewareRules(t *testing.T) {
	s := newTransactor()
	g := idempotency.New(s, idempotency.Options{Retention: time.Hour})
	runs := 0
	handler := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { runs++; w.WriteHeader(http.StatusCreated) })
	made := map[string]time.Time{"late": time.Now().Add(-2 * time.Hour)}
	keyTime := func(_ *http.Request, key string) (time.Time, bool) { t, ok := made[key]; return t, ok }
	withHeader := g.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, KeyTime: keyTime,
		FingerprintHeaders: []string{"Stripe-Account"}, OtherFingerprintHeaders: [][]string{nil}})(handler)
	without := g.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})(handler)
	send := func(h http.Handler, key string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader(`{"amount":1}`))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Stripe-Account", "acct_1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	rec := send(withHeader, "late")
	assert.Equal(t, http.StatusBadRequest, rec.Code)
	assert.Contains(t, rec.Body.String(), `"code":"key-expired"`)
	assert.Zero(t, runs)
	assert.Empty(t, s.done, "what the refused request left")

	require.Equal(t, http.StatusCreated, send(without, "crossing").Code)
	rec = send(withHeader, "crossing")
	assert.Equal(t, http.StatusCreated, rec.Code)
	assert.Equal(t, "true", rec.Header().Get(idempotency.HeaderReplayed))
	assert.Equal(t, 1, runs)
}
