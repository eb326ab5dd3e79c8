package seal_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/seal"
)

// Rotation on one redis-server, as instances restarted with each new key
// configuration see it: records written under key 1 and under key 2 both
// replay while both are configured; a retry across the rotation, whose
// record's fingerprint key 1 made, replays, or takes its record over and
// reads its step, rather than being refused as another request; once key 1
// is removed, its records fail with ErrUnknownKey naming it and run
// nothing, while key 2's still replay.
func TestSealRotation(t *testing.T) {
	srv := testserver.StartRedis(t)
	inner := redisStore(t, srv.Client(), 0)
	key1, key2 := newKey(1), newKey(2)
	g1 := idempotency.New(sealed(t, inner, seal.Keys{Current: key1}), idempotency.Options{})
	old := idempotency.Key{Scope: "acct_1", Name: "before"}
	retried := idempotency.Key{Scope: "acct_1", Name: "retried"}
	complete(t, g1, old, markedResponse("ch_old"))
	_, err := g1.Do(t.Context(), retried, markedRequest, stepThenFail) // released, its point sealed by key 1
	require.ErrorIs(t, err, errCrash)

	g2 := idempotency.New(sealed(t, inner, seal.Keys{Current: key2, Earlier: []seal.Key{key1}}), idempotency.Options{})
	fresh := idempotency.Key{Scope: "acct_1", Name: "after"}
	complete(t, g2, fresh, markedResponse("ch_new"))
	for k, id := range map[idempotency.Key]string{old: "ch_old", fresh: "ch_new"} {
		res, err := g2.Do(t.Context(), k, markedRequest, mustNotRun(t))
		require.NoError(t, err, "a retry of %v with keys 2 and 1", k)
		assert.True(t, res.Replayed)
		assert.Equal(t, markedResponse(id), res.Response)
	}
	_, err = g2.Do(t.Context(), old, idempotency.FingerprintOf("another", nil), mustNotRun(t))
	require.ErrorIs(t, err, idempotency.ErrMismatch, "another request with key 1's record's key")
	res, err := g2.Do(t.Context(), retried, markedRequest, func(ctx context.Context) (idempotency.Response, error) {
		step, err := idempotency.Step(ctx, "charge", func(context.Context) (string, error) { return "ran again", nil })
		return idempotency.Response{Status: http.StatusCreated, Body: []byte(step)}, err
	})
	require.NoError(t, err, "the retry across the rotation")
	assert.Equal(t, "ch_"+marker, string(res.Response.Body), "the step key 1 sealed, read after the rotation")
	assert.False(t, res.Replayed)

	g3 := idempotency.New(sealed(t, inner, seal.Keys{Current: key2}), idempotency.Options{})
	for _, k := range []idempotency.Key{old, retried} {
		res, err := g3.Do(t.Context(), k, markedRequest, mustNotRun(t))
		require.ErrorIs(t, err, seal.ErrUnknownKey, "a retry of %v, whose fingerprint key 1 made, once key 1 is removed", k)
		assert.Contains(t, err.Error(), "key ID 1")
		assert.False(t, errors.Is(err, idempotency.ErrUnavailable), "an error FailOpen would run the handler on")
		assert.Zero(t, res)
	}
	res, err = g3.Do(t.Context(), fresh, markedRequest, mustNotRun(t))
	require.NoError(t, err, "key 2's record, once key 1 is removed")
	assert.Equal(t, markedResponse("ch_new"), res.Response)
}

// A record whose key was removed is answered 503 by the middleware, even
// with FailOpen, and the handler does not run: its operation may have run.
func TestSealUnknownKeyMiddleware(t *testing.T) {
	inner := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	key1, key2 := newKey(1), newKey(2)
	var ran atomic.Int32
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ran.Add(1)
		w.Header().Set("X-Card", marker)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(marker))
	})
	serve := func(keys seal.Keys) *httptest.ResponseRecorder {
		g := idempotency.New(sealed(t, inner, keys), idempotency.Options{})
		h := g.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, FailOpen: true})(handler)
		r := httptest.NewRequest(http.MethodPost, "/v1/charges", strings.NewReader(`{"amount":100}`))
		r.Header.Set("Idempotency-Key", "charge-1")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	require.Equal(t, http.StatusCreated, serve(seal.Keys{Current: key1}).Code)
	w := serve(seal.Keys{Current: key2, Earlier: []seal.Key{key1}})
	require.Equal(t, http.StatusCreated, w.Code)
	assert.Equal(t, "true", w.Header().Get("Idempotent-Replayed"))
	assert.Equal(t, marker, w.Body.String())

	w = serve(seal.Keys{Current: key2})
	assert.Equal(t, http.StatusServiceUnavailable, w.Code)
	assert.NotContains(t, w.Body.String(), marker)
	assert.Equal(t, int32(1), ran.Load(), "the handler's runs")
}

// A step sealed under a key since removed fails the step before it runs
// again, and the record is released, not completed; the operator's bare
// Guard (the idempotency command has no keys) can still forget the record.
func TestSealStepUnderRemovedKey(t *testing.T) {
	inner := memory()
	key1, key2 := newKey(1), newKey(2)
	k := idempotency.Key{Scope: "acct_1", Name: "charge"}
	token := own(t, sealed(t, inner, seal.Keys{Current: key2}), k) // its fingerprint keyed by key 2
	require.NoError(t, inner.Release(t.Context(), k, token))
	// An instance still writing with key 1, key 2 only accepted, takes it over and records a step.
	_, err := idempotency.New(sealed(t, inner, seal.Keys{Current: key1, Earlier: []seal.Key{key2}}), idempotency.Options{}).
		Do(t.Context(), k, markedRequest, stepThenFail)
	require.ErrorIs(t, err, errCrash)

	_, err = idempotency.New(sealed(t, inner, seal.Keys{Current: key2}), idempotency.Options{}).
		Do(t.Context(), k, markedRequest, func(ctx context.Context) (idempotency.Response, error) {
			_, err := idempotency.Step(ctx, "charge", func(context.Context) (string, error) {
				t.Error("the step ran again")
				return "", nil
			})
			return idempotency.Response{Status: http.StatusCreated}, err
		})
	require.ErrorIs(t, err, seal.ErrUnknownKey)
	assert.Contains(t, err.Error(), "key ID 1")
	rec, err := inner.Inspect(t.Context(), k)
	require.NoError(t, err)
	assert.Equal(t, idempotency.RecordReleased, rec.State)
	assert.Equal(t, []string{"charge"}, rec.Steps)

	require.NoError(t, idempotency.New(inner, idempotency.Options{}).Act(t.Context(), rec,
		idempotency.OperatorAction{Disposition: idempotency.Forget, Force: true}), "the bare command's forget")
	_, err = inner.Inspect(t.Context(), k)
	require.ErrorIs(t, err, idempotency.ErrNoRecord)
}
