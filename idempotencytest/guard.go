package idempotencytest

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/require"
)

// guard checks a Guard over the store. Many concurrent Do calls with one key
// run the operation once and all get its response, all but one as a replay.
// After the operation fails, the next Do runs it again as a takeover of the
// same operation: the same operation ID, attempt 2 and a greater token; a
// later Do replays it. A Do with another fingerprint fails with ErrMismatch.
func guard(e *env) {
	// The long recheck interval leaves the store's wake-ups as the only way a
	// waiter learns the outcome in time.
	g := idempotency.New(e.store, idempotency.Options{Lease: longLease, WaitTimeout: wakeTimeout, RecheckInterval: time.Hour})
	fp := fingerprint("a")
	want := idempotency.Response{Status: http.StatusCreated,
		Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"id":"ch_1"}`)}
	e.run("RunsOnce", func(e *env) {
		k := e.key("guard")
		var runs, calling atomic.Int32
		allCalling := make(chan struct{})
		results := make([]idempotency.Result, claimers)
		errs := make([]error, claimers)
		var wg sync.WaitGroup
		for i := range claimers {
			wg.Go(func() {
				if calling.Add(1) == claimers {
					close(allCalling)
				}
				results[i], errs[i] = g.Do(e.ctx, k, fp, func(context.Context) (idempotency.Response, error) {
					runs.Add(1)
					// Hold the record until every caller has come, so that
					// most of them wait for it.
					<-allCalling
					return want, nil
				})
			})
		}
		wg.Wait()
		require.NoError(e.t, errors.Join(errs...), "concurrent Do")
		require.EqualValues(e.t, 1, runs.Load(), "runs of fn")
		require.NotEmpty(e.t, results[0].OperationID, "Do's operation ID")
		replayed := 0
		for i, r := range results {
			requireResponse(e.t, want, r.Response, fmt.Sprintf("Do %d", i))
			require.Equal(e.t, results[0].OperationID, r.OperationID, "Do %d: operation ID", i)
			if r.Replayed {
				replayed++
			}
		}
		require.Equal(e.t, claimers-1, replayed, "replayed results")
	})
	e.run("RetryAfterError", func(e *env) {
		k := e.key("guard-retry")
		type attempt struct {
			ok          bool
			operationID string
			attempt     int
			token       uint64
			takeover    bool
		}
		seen := func(ctx context.Context) attempt {
			i, ok := idempotency.FromContext(ctx)
			if !ok {
				return attempt{}
			}
			return attempt{true, i.OperationID, i.Attempt, i.Token, i.Takeover}
		}
		var first, second attempt
		boom := errors.New("the provider timed out")
		_, err := g.Do(e.ctx, k, fp, func(ctx context.Context) (idempotency.Response, error) {
			first = seen(ctx)
			return idempotency.Response{}, boom
		})
		require.ErrorIs(e.t, err, boom, "Do whose fn failed")
		require.True(e.t, first.ok, "fn's context carries no Info")
		require.Equal(e.t, 1, first.attempt, "the first attempt's number")
		require.False(e.t, first.takeover, "the first attempt's Takeover")

		res, err := g.Do(e.ctx, k, fp, func(ctx context.Context) (idempotency.Response, error) {
			second = seen(ctx)
			return want, nil
		})
		require.NoError(e.t, err, "Do after the failed attempt")
		require.True(e.t, second.ok, "fn's context carries no Info")
		require.Equal(e.t, first.operationID, second.operationID, "the retry's operation ID")
		require.Equal(e.t, 2, second.attempt, "the retry's attempt number")
		require.True(e.t, second.takeover, "the retry's Takeover")
		require.Greater(e.t, second.token, first.token, "the retry's token must be greater than the first attempt's")
		require.False(e.t, res.Replayed, "the retry's Replayed")
		require.Equal(e.t, first.operationID, res.OperationID, "the retry's Result.OperationID")
		requireResponse(e.t, want, res.Response, "the retry's response")

		res, err = g.Do(e.ctx, k, fp, func(context.Context) (idempotency.Response, error) {
			e.t.Error("fn ran for a completed record")
			return idempotency.Response{}, nil
		})
		require.NoError(e.t, err, "Do after completion")
		require.True(e.t, res.Replayed, "Replayed after completion")
		require.Equal(e.t, first.operationID, res.OperationID, "Result.OperationID after completion")
		requireResponse(e.t, want, res.Response, "the replayed response")
	})
	e.run("Mismatch", func(e *env) {
		k := e.key("guard-mismatch")
		_, err := g.Do(e.ctx, k, fp, func(context.Context) (idempotency.Response, error) { return want, nil })
		require.NoError(e.t, err, "first Do")
		_, err = g.Do(e.ctx, k, fingerprint("b"), func(context.Context) (idempotency.Response, error) {
			e.t.Error("fn ran for a request that does not match the record")
			return idempotency.Response{}, nil
		})
		require.ErrorIs(e.t, err, idempotency.ErrMismatch, "Do with another fingerprint")
	})
}
