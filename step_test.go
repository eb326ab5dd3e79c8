package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// ledger counts each step's runs, without de-duplicating.
type ledger struct {
	mu   sync.Mutex
	runs map[string]int
}

func (l *ledger) step(ctx context.Context, name string, fail error) (string, error) {
	return idempotency.Step(ctx, name, func(context.Context) (string, error) {
		l.mu.Lock()
		defer l.mu.Unlock()
		if l.runs == nil {
			l.runs = map[string]int{}
		}
		l.runs[name]++
		if fail != nil {
			return "", fail
		}
		return name + "_1", nil
	})
}

func (l *ledger) count(name string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.runs[name]
}

// An attempt that fails after two steps leaves them recorded: the next
// attempt resumes with their results, and runs only the step that failed.
func TestStepResumesAfterTheLastRecordedStep(t *testing.T) {
	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	k, fp := idempotency.Key{Scope: "acct_1", Name: "order-1"}, idempotency.FingerprintOf("order", nil)
	var l ledger
	receiptDown := errors.New("mail server down")
	op := func(fail error) func(ctx context.Context) (idempotency.Response, error) {
		return func(ctx context.Context) (idempotency.Response, error) {
			order, err1 := l.step(ctx, "order", nil)
			charge, err2 := l.step(ctx, "charge", nil)
			receipt, err3 := l.step(ctx, "receipt", fail)
			if err := errors.Join(err1, err2, err3); err != nil {
				return idempotency.Response{}, err
			}
			return idempotency.Response{Status: 201, Body: []byte(order + " " + charge + " " + receipt)}, nil
		}
	}
	_, err := g.Do(t.Context(), k, fp, op(receiptDown))
	require.ErrorIs(t, err, receiptDown)
	res, err := g.Do(t.Context(), k, fp, op(nil))
	require.NoError(t, err)
	assert.Equal(t, "order_1 charge_1 receipt_1", string(res.Response.Body))
	assert.Equal(t, 1, l.count("order"), "order runs")
	assert.Equal(t, 1, l.count("charge"), "charge runs")
	assert.Equal(t, 2, l.count("receipt"), "receipt runs: it failed once")
}

// A crashed attempt's steps reach the Recover hook, which resumes the
// operation after them; a step recorded in the hook is not run again.
func TestStepsReachRecoverHook(t *testing.T) {
	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	var seen []string
	var l ledger
	opts := idempotency.Options{Lease: 200 * time.Millisecond, Recover: func(ctx context.Context) (idempotency.Response, error) {
		info, _ := idempotency.FromContext(ctx)
		ps, err := info.RecoveryPoints(ctx)
		for _, p := range ps {
			seen = append(seen, p.Step+"="+string(p.Result))
		}
		if err == nil {
			_, err = idempotency.Step(ctx, "charge", func(context.Context) (string, error) { return "ch_found", nil })
		}
		idempotency.SetDisposition(ctx, idempotency.Release)
		return idempotency.Response{}, err
	}}
	k, fp := idempotency.Key{Name: "crash-1"}, idempotency.FingerprintOf("order", nil)
	stuck := make(chan struct{})
	defer close(stuck)
	crashed := idempotency.New(silentRenewals{store}, opts)
	go func() {
		_, _ = crashed.Do(context.Background(), k, fp, func(ctx context.Context) (idempotency.Response, error) {
			_, _ = l.step(ctx, "order", nil)
			<-stuck // the process stops here, as if killed, and never settles
			return idempotency.Response{}, nil
		})
	}()
	require.Eventually(t, func() bool { return l.count("order") == 1 }, 5*time.Second, time.Millisecond)
	time.Sleep(300 * time.Millisecond)
	res, err := idempotency.New(store, opts).Do(t.Context(), k, fp, func(ctx context.Context) (idempotency.Response, error) {
		order, err1 := l.step(ctx, "order", nil)
		charge, err2 := l.step(ctx, "charge", nil)
		return idempotency.Response{Status: 201, Body: []byte(order + " " + charge)}, errors.Join(err1, err2)
	})
	require.NoError(t, err)
	assert.Equal(t, []string{`order="order_1"`}, seen, "the points the hook saw")
	assert.Equal(t, "order_1 ch_found", string(res.Response.Body))
	assert.Equal(t, 1, l.count("order"))
	assert.Zero(t, l.count("charge"), "the charge the hook recorded ran again")
}

// silentRenewals is a store whose owners' renewals never get through, as
// for an owner that was killed: its lease runs out.
type silentRenewals struct{ *idempotency.MemoryStore }

func (silentRenewals) Heartbeat(context.Context, idempotency.Key, uint64, time.Duration) error {
	return idempotency.ErrUnavailable
}

// An attempt's Forget after a step keeps the operation: the retry resumes
// after the step. Only an operator's forget erases the record and its
// points: the key made anew runs every step again.
func TestStepsGoWithTheRecord(t *testing.T) {
	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	g := idempotency.New(store, idempotency.Options{})
	k, fp := idempotency.Key{Name: "forgotten"}, idempotency.FingerprintOf("order", nil)
	var l ledger
	forget := func(ctx context.Context) (idempotency.Response, error) {
		_, err := l.step(ctx, "order", nil)
		idempotency.SetDisposition(ctx, idempotency.Forget)
		return idempotency.Response{}, err
	}
	_, err := g.Do(t.Context(), k, fp, forget)
	require.NoError(t, err)
	_, err = g.Do(t.Context(), k, fp, forget)
	require.NoError(t, err)
	assert.Equal(t, 1, l.count("order"), "runs of a step after an attempt's Forget")

	seen, err := store.Inspect(t.Context(), k)
	require.NoError(t, err)
	require.NoError(t, g.Act(t.Context(), seen, idempotency.OperatorAction{Disposition: idempotency.Forget}))
	_, err = g.Do(t.Context(), k, fp, forget)
	require.NoError(t, err)
	assert.Equal(t, 2, l.count("order"), "runs of a step after an operator's forget")
}

// Misuse is refused before the step runs, except a result too large to
// record, which is known only once it ran.
func TestStepRefusals(t *testing.T) {
	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	ran := 0
	fn := func(context.Context) (int, error) { ran++; return ran, nil }
	_, err := idempotency.Step(t.Context(), "order", fn)
	require.ErrorIs(t, err, idempotency.ErrNoOperation)

	_, err = g.Do(t.Context(), idempotency.Key{Name: "misuse"}, idempotency.Fingerprint{}, func(ctx context.Context) (idempotency.Response, error) {
		for _, name := range []string{"", "has space", strings.Repeat("x", idempotency.MaxStepName+1)} {
			_, err := idempotency.Step(ctx, name, fn)
			assert.ErrorIs(t, err, idempotency.ErrInvalidStep, "name %q", name)
		}
		assert.Zero(t, ran, "a step with a bad name ran")
		for i := range idempotency.MaxSteps {
			_, err := idempotency.Step(ctx, "s"+strings.Repeat("x", i), fn)
			require.NoError(t, err)
		}
		_, err := idempotency.Step(ctx, "one-too-many", fn)
		assert.ErrorIs(t, err, idempotency.ErrInvalidStep)
		assert.Equal(t, idempotency.MaxSteps, ran, "the step past the limit ran")
		return idempotency.Response{}, nil
	})
	require.NoError(t, err)

	_, err = g.Do(t.Context(), idempotency.Key{Name: "large"}, idempotency.Fingerprint{}, func(ctx context.Context) (idempotency.Response, error) {
		big, err := idempotency.Step(ctx, "big", func(context.Context) (string, error) {
			return strings.Repeat("x", idempotency.MaxStepResult), nil
		})
		assert.ErrorIs(t, err, idempotency.ErrInvalidStep)
		assert.Len(t, big, idempotency.MaxStepResult, "the result of the step that ran")
		return idempotency.Response{}, err
	})
	require.ErrorIs(t, err, idempotency.ErrInvalidStep)

	plain := idempotency.New(struct{ idempotency.Store }{idempotency.NewMemoryStore(idempotency.MemoryOptions{})}, idempotency.Options{})
	_, err = plain.Do(t.Context(), idempotency.Key{Name: "plain"}, idempotency.Fingerprint{}, func(ctx context.Context) (idempotency.Response, error) {
		_, err := idempotency.Step(ctx, "order", fn)
		return idempotency.Response{}, err
	})
	require.ErrorIs(t, err, idempotency.ErrNoRecoveryPoints)
}

// An owner whose lease was lost cannot record a step: Step fails with
// ErrFenced, and the step is left to the next owner.
func TestStepAfterLostLeaseIsFenced(t *testing.T) {
	now := time.Now()
	var mu sync.Mutex
	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{Now: func() time.Time { mu.Lock(); defer mu.Unlock(); return now }})
	g := idempotency.New(store, idempotency.Options{Lease: time.Second})
	k, fp := idempotency.Key{Name: "fenced"}, idempotency.Fingerprint{}
	_, err := g.Do(t.Context(), k, fp, func(ctx context.Context) (idempotency.Response, error) {
		_, err := idempotency.Step(ctx, "charge", func(context.Context) (string, error) {
			mu.Lock()
			now = now.Add(2 * time.Second) // the store's lease runs out, and a retry takes over
			mu.Unlock()
			c, err := store.Claim(t.Context(), idempotency.ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op-2", Lease: time.Minute, Retention: time.Hour})
			require.NoError(t, err)
			require.Equal(t, idempotency.Owner, c.State)
			return "ch_1", nil
		})
		assert.ErrorIs(t, err, idempotency.ErrFenced)
		assert.ErrorIs(t, ctx.Err(), context.Canceled, "the operation's context after a fenced step")
		return idempotency.Response{}, err
	})
	require.ErrorIs(t, err, idempotency.ErrFenced)
}

// StepCodec records and replays a step's result in the codec's encoding.
func TestStepCodec(t *testing.T) {
	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	k, fp := idempotency.Key{Name: "xml"}, idempotency.Fingerprint{}
	runs := 0
	var got []charge
	op := func(fail bool) func(ctx context.Context) (idempotency.Response, error) {
		return func(ctx context.Context) (idempotency.Response, error) {
			c, err := idempotency.StepCodec(ctx, xmlCodec{}, "charge", func(context.Context) (charge, error) {
				runs++
				return charge{ID: "ch_1", Amount: 100, At: time.Date(2026, 12, 2, 9, 0, 0, 0, time.UTC)}, nil
			})
			got = append(got, c)
			if fail {
				return idempotency.Response{}, errors.New("a later step failed")
			}
			return idempotency.Response{}, err
		}
	}
	_, err := g.Do(t.Context(), k, fp, op(true))
	require.Error(t, err)
	_, err = g.Do(t.Context(), k, fp, op(false))
	require.NoError(t, err)
	assert.Equal(t, 1, runs)
	require.Len(t, got, 2)
	assert.Equal(t, got[0], got[1])
}

// A record that a migrating store moves from the old store brings its
// steps along: the operation resumes after them.
func TestStepsMoveWithAMigratedRecord(t *testing.T) {
	for _, dual := range []bool{false, true} {
		old, next := idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.NewMemoryStore(idempotency.MemoryOptions{})
		k, fp := idempotency.Key{Name: "moved"}, idempotency.FingerprintOf("order", nil)
		var l ledger
		_, err := idempotency.New(old, idempotency.Options{}).Do(t.Context(), k, fp, func(ctx context.Context) (idempotency.Response, error) {
			_, err := l.step(ctx, "order", nil)
			return idempotency.Response{}, errors.Join(err, errors.New("the charge failed"))
		})
		require.Error(t, err)
		g := idempotency.New(idempotency.NewMigratingStore(old, next, idempotency.MigrationOptions{DualWrite: dual}), idempotency.Options{})
		res, err := g.Do(t.Context(), k, fp, func(ctx context.Context) (idempotency.Response, error) {
			order, err1 := l.step(ctx, "order", nil)
			charge, err2 := l.step(ctx, "charge", nil)
			return idempotency.Response{Status: 201, Body: []byte(order + " " + charge)}, errors.Join(err1, err2)
		})
		require.NoError(t, err, "dual write %v", dual)
		assert.Equal(t, "order_1 charge_1", string(res.Response.Body))
		assert.Equal(t, 1, l.count("order"), "dual write %v: order runs", dual)
	}
}

// silentPoints is a store whose saves of recovery points never answer.
type silentPoints struct{ *idempotency.MemoryStore }

func (silentPoints) SaveRecoveryPoint(ctx context.Context, _ idempotency.Key, _ uint64, _ idempotency.RecoveryPoint) error {
	<-ctx.Done()
	return ctx.Err()
}

// A save that the store does not answer before the lease's local end fails
// as a store failure does, never with the bare context error.
func TestStepUnansweredSave(t *testing.T) {
	g := idempotency.New(silentPoints{idempotency.NewMemoryStore(idempotency.MemoryOptions{})}, idempotency.Options{Lease: 300 * time.Millisecond})
	_, err := g.Do(t.Context(), idempotency.Key{Name: "silent"}, idempotency.Fingerprint{}, func(ctx context.Context) (idempotency.Response, error) {
		_, err := idempotency.Step(ctx, "charge", func(context.Context) (string, error) { return "ch_1", nil })
		return idempotency.Response{}, err
	})
	require.Error(t, err)
	assert.True(t, errors.Is(err, idempotency.ErrUnavailable) || errors.Is(err, idempotency.ErrFenced), "%v", err)
}

// slowSaves is a store whose recovery points take hold long after they are
// sent, as a save that waits for a pool's new connection does, while the
// owner's renewals still get through.
type slowSaves struct {
	*idempotency.MemoryStore
	delay time.Duration
}

func (s slowSaves) SaveRecoveryPoint(ctx context.Context, k idempotency.Key, token uint64, p idempotency.RecoveryPoint) error {
	select {
	case <-time.After(s.delay):
	case <-ctx.Done():
		return fmt.Errorf("%w: %w", idempotency.ErrUnavailable, ctx.Err())
	}
	return s.MemoryStore.SaveRecoveryPoint(ctx, k, token, p)
}

// A step's save that outlasts the lease's end as it stood when the save
// began, while renewals move that end, is recorded: the save lasts as long
// as the lease does, so the step is not run again.
func TestSlowSaveOutlastsTheLeaseItBeganUnder(t *testing.T) {
	const lease = 300 * time.Millisecond
	store := slowSaves{idempotency.NewMemoryStore(idempotency.MemoryOptions{}), lease}
	g := idempotency.New(store, idempotency.Options{Lease: lease})
	k, fp := idempotency.Key{Name: "slow-save"}, idempotency.FingerprintOf("charge", nil)
	var l ledger
	res, err := g.Do(t.Context(), k, fp, func(ctx context.Context) (idempotency.Response, error) {
		charge, err := l.step(ctx, "charge", nil)
		return idempotency.Response{Status: 201, Body: []byte(charge)}, err
	})
	require.NoError(t, err, "an operation whose step's save outlasted the lease it began under")
	assert.Equal(t, "charge_1", string(res.Response.Body))
	assert.Equal(t, 1, l.count("charge"))
}
