package postgres

import (
	"context"
	"text/template"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/jackc/pgx/v5"
)

// CompleteTxAs is CompleteTx for a record claimed without a Guard, under the
// key, token and retention given.
func (s *Store) CompleteTxAs(ctx context.Context, tx pgx.Tx, k idempotency.Key, token uint64, resp idempotency.Response, retention time.Duration) error {
	return s.completeRecord(ctx, inTx(tx), k, token, resp, retention)
}

// MigrateWith runs src, the schema.sql of an earlier version, as Migrate
// runs the current one, so that tests can upgrade from it.
func (s *Store) MigrateWith(ctx context.Context, src string) error {
	return s.migrate(ctx, template.Must(template.New("schema.sql").Option("missingkey=error").Parse(src)))
}
