package postgres

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
)

// errStoreEnds is returned by Commit and Rollback of a one-commit
// operation's transaction: the store ends it with the record's outcome.
var errStoreEnds = errors.New("postgres: the one-commit transaction is ended by the store with its record; return an error to roll it back")

// opTx is the pgx.Tx a one-commit operation is handed: the transaction of
// its claim, whose Commit and Rollback are refused, so that the operation
// cannot end it apart from its record. Begin makes a savepoint, which the
// operation commits or rolls back as it likes.
type opTx struct{ pgx.Tx }

func (opTx) Commit(context.Context) error   { return errStoreEnds }
func (opTx) Rollback(context.Context) error { return errStoreEnds }
