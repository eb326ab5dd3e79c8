package postgres_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/postgres"
)

// chargeStep is the function of a step that writes a charge and records the
// step in one transaction, with the charge's ID as its result. Before it
// commits, with the step's context, it calls beforeCommit, whose error rolls
// the transaction back and is the step's.
func chargeStep(f *fixture, s *postgres.Store, table string, beforeCommit func(ctx context.Context) error) func(context.Context) (string, error) {
	return func(ctx context.Context) (string, error) {
		info, _ := idempotency.FromContext(ctx)
		tx, err := f.pool.Begin(ctx)
		if err != nil {
			return "", err
		}
		defer tx.Rollback(context.Background())
		if _, err := tx.Exec(ctx, "INSERT INTO "+table+" (operation_id, amount) VALUES ($1, 100)", info.OperationID); err != nil {
			return "", err
		}
		id := "ch_" + info.OperationID
		if err := s.StepTx(ctx, tx, id); err != nil {
			return "", err
		}
		if err := beforeCommit(ctx); err != nil {
			return "", err
		}
		return id, tx.Commit(ctx)
	}
}

// chargeOperation is an operation for Guard.Do made of the step "charge",
// answering with the charge's ID and the recovery points it saw after it.
func chargeOperation(step func(context.Context) (string, error), seen *[]idempotency.RecoveryPoint) func(context.Context) (idempotency.Response, error) {
	return func(ctx context.Context) (idempotency.Response, error) {
		id, err := idempotency.Step(ctx, "charge", step)
		if err != nil {
			return idempotency.Response{}, err
		}
		info, _ := idempotency.FromContext(ctx)
		if *seen, err = info.RecoveryPoints(ctx); err != nil {
			return idempotency.Response{}, err
		}
		return idempotency.Response{Status: 201, Body: []byte(id)}, nil
	}
}

// pointsOf reads the recovery points column of k's row as it is committed.
func pointsOf(t *testing.T, f *fixture, table string, k idempotency.Key) []byte {
	t.Helper()
	var b []byte
	require.NoError(t, f.pool.QueryRow(t.Context(), "SELECT points FROM "+pgx.Identifier{table}.Sanitize()+
		" WHERE scope = $1 AND key = $2", k.Scope, k.Name).Scan(&b))
	return b
}

// A step's business write and its recovery point commit together: neither
// is visible before the commit, both after. An attempt that fails after the
// step leaves it recorded, and the retry resumes after it, with its result,
// without charging again; the completion drops the points.
func testStepTxCommit(t *testing.T, f *fixture) {
	s, o := f.store(t)
	table := charges(t, f, o)
	g := idempotency.New(s, idempotency.Options{Lease: longLease, Retention: longRetention})
	k, print := key("step"), fp("step")
	runs := 0
	step := chargeStep(f, s, table, func(ctx context.Context) error {
		runs++
		info, _ := idempotency.FromContext(ctx)
		assert.Zero(t, count(t, f, table), "the charge before the commit")
		ps, err := s.RecoveryPoints(ctx, k, info.Token)
		assert.NoError(t, err)
		assert.Empty(t, ps, "the recovery points before the commit")
		return nil
	})
	var id string
	failed := errors.New("the operation failed after its step")
	_, err := g.Do(t.Context(), k, print, func(ctx context.Context) (idempotency.Response, error) {
		id, _ = idempotency.Step(ctx, "charge", step)
		return idempotency.Response{}, failed
	})
	require.ErrorIs(t, err, failed)
	assert.Equal(t, 1, count(t, f, table), "the charge committed")
	assert.NotEmpty(t, pointsOf(t, f, o.Table, k), "the step committed")

	var seen []idempotency.RecoveryPoint
	res, err := g.Do(t.Context(), k, print, chargeOperation(step, &seen))
	require.NoError(t, err)
	assert.Equal(t, 1, runs, "runs of the step")
	assert.Equal(t, 1, count(t, f, table), "charges")
	assert.Equal(t, id, string(res.Response.Body), "the retry's step answered with the committed result")
	assert.Equal(t, []idempotency.RecoveryPoint{{Step: "charge", Result: []byte(`"` + id + `"`)}}, seen)
	assert.Nil(t, pointsOf(t, f, o.Table, k), "the points of the completed record")
}

// A step whose transaction rolls back after StepTx records nothing: the
// next attempt runs it again, and it charges once.
func testStepTxRollback(t *testing.T, f *fixture) {
	s, o := f.store(t)
	table := charges(t, f, o)
	g := idempotency.New(s, idempotency.Options{Lease: longLease, Retention: longRetention})
	k, print := key("rollback"), fp("rollback")
	runs := 0
	step := chargeStep(f, s, table, func(context.Context) error {
		runs++
		if runs == 1 {
			return errors.New("the business transaction failed")
		}
		return nil
	})
	var seen []idempotency.RecoveryPoint
	_, err := g.Do(t.Context(), k, print, chargeOperation(step, &seen))
	require.ErrorContains(t, err, "business transaction failed")
	assert.Zero(t, count(t, f, table), "the charge rolled back")
	assert.Nil(t, pointsOf(t, f, o.Table, k), "the step rolled back")

	res, err := g.Do(t.Context(), k, print, chargeOperation(step, &seen))
	require.NoError(t, err)
	assert.Equal(t, 2, runs, "the step ran again")
	assert.Equal(t, 1, count(t, f, table), "charges")
	assert.Equal(t, []idempotency.RecoveryPoint{{Step: "charge", Result: []byte(`"` + string(res.Response.Body) + `"`)}}, seen)
}

// StepTx says what is wrong with a context in which it cannot record a
// step, rather than reporting a lost lease: no operation, an operation
// outside a step, another Guard's store, or a result over the limit.
func testStepTxWrongContext(t *testing.T, f *fixture) {
	s, _ := f.store(t)
	other, _ := f.store(t)
	inTx := func(ctx context.Context, result string) error {
		tx, err := f.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(context.Background())
		return s.StepTx(ctx, tx, result)
	}
	require.ErrorIs(t, inTx(t.Context(), "r"), idempotency.ErrInvalidStep, "no operation")

	g := idempotency.New(s, idempotency.Options{})
	_, err := g.Do(t.Context(), key("outside"), fp("x"), func(ctx context.Context) (idempotency.Response, error) {
		return idempotency.Response{}, inTx(ctx, "r")
	})
	require.ErrorIs(t, err, idempotency.ErrInvalidStep, "an operation outside a step")

	inStep := func(g *idempotency.Guard, name, result string) error {
		_, err := g.Do(t.Context(), key(name), fp("x"), func(ctx context.Context) (idempotency.Response, error) {
			_, err := idempotency.Step(ctx, "step", func(ctx context.Context) (string, error) { return result, inTx(ctx, result) })
			return idempotency.Response{}, err
		})
		return err
	}
	for name, g := range map[string]*idempotency.Guard{
		"memory":        idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{}),
		"another-table": idempotency.New(other, idempotency.Options{}),
	} {
		err := inStep(g, "foreign-"+name, "r")
		require.ErrorIs(t, err, idempotency.ErrForeignStore, name)
		assert.NotErrorIs(t, err, idempotency.ErrFenced, name)
	}
	err = inStep(g, "large", strings.Repeat("x", idempotency.MaxStepResult))
	require.ErrorIs(t, err, idempotency.ErrInvalidStep, "a result over the limit")
}

// StepTx is refused once the owner's lease has run out by the database's
// clock, though no claim has taken the record over yet: the step's
// transaction rolls back, and the retry runs the step again.
func testStepTxLostLease(t *testing.T, f *fixture) {
	s, o := f.store(t)
	table := charges(t, f, o)
	g := idempotency.New(s, idempotency.Options{Lease: longLease, Retention: longRetention})
	k, print := key("lost"), fp("lost")
	runs := 0
	step := chargeStep(f, s, table, func(context.Context) error { runs++; return nil })
	var stepErr error
	_, err := g.Do(t.Context(), k, print, func(ctx context.Context) (idempotency.Response, error) {
		info, _ := idempotency.FromContext(ctx)
		if err := s.Abandon(ctx, k, info.Token); err != nil {
			return idempotency.Response{}, err
		}
		_, stepErr = idempotency.Step(ctx, "charge", step)
		return idempotency.Response{}, stepErr
	})
	require.ErrorIs(t, stepErr, idempotency.ErrFenced, "StepTx after the lease ran out")
	require.ErrorIs(t, err, idempotency.ErrFenced)
	assert.Zero(t, runs, "the step went on after StepTx")
	assert.Zero(t, count(t, f, table), "charges")
	assert.Nil(t, pointsOf(t, f, o.Table, k), "the points")

	var seen []idempotency.RecoveryPoint
	res, err := g.Do(t.Context(), k, print, chargeOperation(step, &seen))
	require.NoError(t, err)
	assert.Equal(t, 1, runs, "runs of the step")
	assert.Equal(t, 1, count(t, f, table), "charges")
	assert.Equal(t, []idempotency.RecoveryPoint{{Step: "charge", Result: []byte(`"` + string(res.Response.Body) + `"`)}}, seen)
}
