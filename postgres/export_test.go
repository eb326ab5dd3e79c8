package postgres

import (
	"context"
	"text/template"
)

// MigrateWith runs src, the schema.sql of an earlier version, as Migrate
// runs the current one, so that tests can upgrade from it.
func (s *Store) MigrateWith(ctx context.Context, src string) error {
	return s.migrate(ctx, template.Must(template.New("schema.sql").Option("missingkey=error").Parse(src)))
}
