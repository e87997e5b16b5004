//! Log lines for journald: its level prefix on plain lines.

use tracing::{Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// A plain line with the sd-daemon(3) level prefix (`<3>` error, `<4>`
/// warning, `<6>` info, `<7>` debug), which journald turns into the
/// entry's priority; the journal stamps the time itself.
pub struct SyslogPrefixed<F>(pub F);

/// The prefix for `level`.
pub fn syslog_prefix(level: Level) -> &'static str {
    match level {
        Level::ERROR => "<3>",
        Level::WARN => "<4>",
        Level::INFO => "<6>",
        _ => "<7>",
    }
}

impl<S, N, F> FormatEvent<S, N> for SyslogPrefixed<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        writer.write_str(syslog_prefix(*event.metadata().level()))?;
        self.0.format_event(ctx, writer, event)
    }
}
