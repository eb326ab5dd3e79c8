package idempotencytest

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/require"
)

// refusalKeepsOperation checks the Guard's rule that an operation which may
// have had an effect is never erased by a refusal. Through the middleware,
// for every refusal DefaultDisposition forgets: attempt 1 records a step and
// answers 503; attempt 2 answers the refusal; attempt 3 resumes after the
// step, which ran once, under the same DownstreamKey on all three. Through
// Do, an explicit Forget is a release once a step began, and on a takeover.
// A refusal of a first attempt that began no step still forgets the key, so
// a corrected request may reuse it. A store that keeps no recovery points
// skips the cases with steps.
func refusalKeepsOperation(e *env) {
	e.skipWithoutRecoveryPoints()
	g := idempotency.New(e.store, idempotency.Options{Lease: longLease, Retention: longRetention})
	for _, status := range []int{400, 401, 403, 408, 409, 422, 429} {
		e.run(fmt.Sprintf("Middleware%d", status), func(e *env) {
			name := e.key("refused").Name
			var charges atomic.Int32
			keys := map[string]bool{}
			h := g.Middleware(idempotency.MiddlewareOptions{Scope: func(*http.Request) (string, error) { return e.scope, nil }})(
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					i, _ := idempotency.FromContext(r.Context())
					dk, err := idempotency.DownstreamKey(r.Context(), "gateway")
					require.NoError(e.t, err)
					keys[dk] = true
					_, err = idempotency.Step(r.Context(), "charge", func(context.Context) (string, error) {
						charges.Add(1)
						return "ch_1", nil
					})
					require.NoError(e.t, err, "attempt %d: Step", i.Attempt)
					switch i.Attempt {
					case 1:
						w.WriteHeader(http.StatusServiceUnavailable)
					case 2:
						w.WriteHeader(status)
					default:
						w.WriteHeader(http.StatusCreated)
					}
				}))
			for attempt, want := range []int{http.StatusServiceUnavailable, status, http.StatusCreated, http.StatusCreated} {
				req := httptest.NewRequestWithContext(e.ctx, http.MethodPost, "/charges", strings.NewReader(`{"amount":100}`))
				req.Header.Set("Idempotency-Key", name)
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, req)
				require.Equal(e.t, want, rec.Code, "request %d: status (body %s)", attempt+1, rec.Body)
			}
			require.EqualValues(e.t, 1, charges.Load(), "runs of the step recorded by attempt 1")
			require.Len(e.t, keys, 1, "distinct downstream keys over the attempts")
		})
	}
	e.run("ExplicitForgetAfterStep", func(e *env) {
		k, fp := e.key("forget-after-step"), fingerprint("a")
		var ops []string
		var charges int
		for range 2 {
			res, err := g.Do(e.ctx, k, fp, func(ctx context.Context) (idempotency.Response, error) {
				i, _ := idempotency.FromContext(ctx)
				ops = append(ops, i.OperationID)
				if _, err := idempotency.Step(ctx, "charge", func(context.Context) (int, error) { charges++; return 1, nil }); err != nil {
					return idempotency.Response{}, err
				}
				if i.Attempt == 1 {
					require.True(e.t, idempotency.SetDisposition(ctx, idempotency.Forget))
				}
				return idempotency.Response{Status: http.StatusConflict}, nil
			})
			require.NoError(e.t, err)
			require.False(e.t, res.Replayed)
		}
		require.Equal(e.t, 1, charges, "runs of the step")
		require.Equal(e.t, ops[0], ops[1], "the operation ID after a Forget of an attempt that began a step")
	})
	e.run("ExplicitForgetOnTakeover", func(e *env) {
		k := e.key("forget-takeover")
		var ops []string
		for attempt := 1; attempt <= 3; attempt++ {
			_, err := g.Do(e.ctx, k, fingerprint("a"), func(ctx context.Context) (idempotency.Response, error) {
				i, _ := idempotency.FromContext(ctx)
				require.Equal(e.t, attempt, i.Attempt, "the attempt's number")
				ops = append(ops, i.OperationID)
				switch attempt {
				case 1:
					return idempotency.Response{}, errors.New("the ledger write failed")
				case 2:
					idempotency.SetDisposition(ctx, idempotency.Forget)
				}
				return idempotency.Response{Status: http.StatusOK}, nil
			})
			if attempt == 1 {
				require.Error(e.t, err)
				continue
			}
			require.NoError(e.t, err)
		}
		require.Equal(e.t, []string{ops[0], ops[0], ops[0]}, ops, "operation IDs: a takeover's Forget released the record")
		_, err := g.Do(e.ctx, k, fingerprint("b"), func(context.Context) (idempotency.Response, error) {
			e.t.Error("another request ran under a key whose operation was kept")
			return idempotency.Response{}, nil
		})
		require.ErrorIs(e.t, err, idempotency.ErrMismatch, "another request under the kept operation's key")
	})
	e.run("FirstRefusalForgets", func(e *env) {
		k := e.key("first-refusal")
		_, err := g.Do(e.ctx, k, fingerprint("a"), func(ctx context.Context) (idempotency.Response, error) {
			idempotency.SetDisposition(ctx, idempotency.Forget)
			return idempotency.Response{Status: http.StatusUnprocessableEntity}, nil
		})
		require.NoError(e.t, err)
		res, err := g.Do(e.ctx, k, fingerprint("b"), func(ctx context.Context) (idempotency.Response, error) {
			i, _ := idempotency.FromContext(ctx)
			require.Equal(e.t, 1, i.Attempt, "a corrected request's attempt")
			return idempotency.Response{Status: http.StatusCreated}, nil
		})
		require.NoError(e.t, err, "a corrected request under a key whose first attempt was refused")
		require.Equal(e.t, http.StatusCreated, res.Response.Status)
	})
}

// skipWithoutRecoveryPoints skips a case that records steps on a store that
// keeps no recovery points: one that is no RecoveryPointStore, or answers
// ErrNoRecoveryPoints (a migrating store over stores that keep none).
func (e *env) skipWithoutRecoveryPoints() {
	ps, ok := e.store.(idempotency.RecoveryPointStore)
	if !ok {
		e.t.Skip("the store is no idempotency.RecoveryPointStore")
	}
	req := request(e.key("points"), fingerprint("points"))
	c := e.own(req, 1, req.OperationID, "a claim to ask for recovery points")
	_, err := ps.RecoveryPoints(e.ctx, req.Key, c.Token)
	e.forget(req.Key, c.Token, "the claim that asked for recovery points")
	if errors.Is(err, idempotency.ErrNoRecoveryPoints) {
		e.t.Skip("the store keeps no recovery points:", err)
	}
	require.NoError(e.t, err, "RecoveryPoints")
}
