//! What a failed run's output says about the unit's sandbox: jobs run
//! inside `cronlease.service`, so its hardening (docs/operations.md,
//! "Hardening, and what a job may need to relax") applies to them, and a job
//! that needs more fails with an error that does not name the setting. When
//! the daemon runs under systemd, a failed or unstarted run whose output
//! shows one of those errors gets one more line in its output tail (and a
//! WARN): the setting to relax and how.

/// The line added to a run's output when `text` (its output, or why it
/// could not start) shows an error the unit's sandbox causes; `None` when
/// nothing points at it.
pub fn sandbox_hint(text: &str) -> Option<&'static str> {
    let has = |needle: &str| text.contains(needle);
    let denied = || {
        has("Permission denied")
            || has("No such file or directory")
            || has("Operation not permitted")
    };
    if has("Read-only file system") {
        Some(
            "cronlease: hint: the unit's ProtectSystem=strict keeps the file system read-only but /var/lib/cronlease, /run/cronlease and a private /tmp; add the path in a drop-in (systemctl edit cronlease): ReadWritePaths=/the/path",
        )
    } else if has("cannot run the job as uid") {
        Some(
            "cronlease: hint: a job with `user =` needs the daemon to run as root; in a drop-in (systemctl edit cronlease): User=root, PrivateUsers=no, CapabilityBoundingSet=CAP_SETUID CAP_SETGID CAP_KILL, SystemCallFilter=@setuid",
        )
    } else if has("no new privileges") || has("effective uid is not 0") {
        Some(
            "cronlease: hint: the unit's NoNewPrivileges=yes and RestrictSUIDSGID=yes keep setuid programs (sudo, su, ping) from gaining privileges; relax them in a drop-in (systemctl edit cronlease): NoNewPrivileges=no, RestrictSUIDSGID=no",
        )
    } else if (has("/home/") || has("/root/") || has("/run/user/")) && denied() {
        Some(
            "cronlease: hint: the unit's ProtectHome=yes hides /home, /root and /run/user; in a drop-in (systemctl edit cronlease): ProtectHome=read-only (or no)",
        )
    } else if has("Address family not supported") {
        Some(
            "cronlease: hint: the unit's RestrictAddressFamilies= allows only AF_UNIX, AF_INET and AF_INET6; add the family in a drop-in (systemctl edit cronlease), e.g. RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        )
    } else if has("W^X") || (has("mprotect") && denied()) {
        Some(
            "cronlease: hint: the unit's MemoryDenyWriteExecute=yes stops JIT compilers (Java, Node.js, LuaJIT); in a drop-in (systemctl edit cronlease): MemoryDenyWriteExecute=no",
        )
    } else {
        None
    }
}

/// The line added to the output of a run started as a systemd unit
/// ([`crate::units`]) when `text` shows an error the unit's sandbox causes:
/// the `[job.sandbox]` setting that relaxes it for this job alone.
pub fn unit_sandbox_hint(text: &str) -> Option<&'static str> {
    let has = |needle: &str| text.contains(needle);
    if has("Read-only file system") {
        Some(
            "cronlease: hint: the run's unit keeps /usr, /boot and /etc read-only (ProtectSystem=full; with \"strict\" all but /dev, /proc and /sys); for this job: [job.sandbox] ReadWritePaths = [\"/the/path\"]",
        )
    } else if has("no new privileges") || has("effective uid is not 0") {
        Some(
            "cronlease: hint: the run's unit has NoNewPrivileges=yes and RestrictSUIDSGID=yes, so setuid programs (sudo, su, ping) gain nothing; for this job: [job.sandbox] NoNewPrivileges = false, RestrictSUIDSGID = false (or user = \"root\" instead of sudo)",
        )
    } else {
        None
    }
}

/// Whether this process runs as a systemd service (systemd sets
/// `$INVOCATION_ID` for each of its units' processes): only then is the
/// sandbox the likely cause of those errors.
pub fn under_systemd() -> bool {
    std::env::var_os("INVOCATION_ID").is_some()
}

#[cfg(test)]
mod tests {
    use super::{sandbox_hint, unit_sandbox_hint};

    #[test]
    fn a_units_sandbox_errors_name_the_jobs_setting() {
        for (output, setting) in [
            (
                "sh: 1: cannot create /srv/x/no: Read-only file system",
                "[job.sandbox] ReadWritePaths",
            ),
            (
                "sudo: The \"no new privileges\" flag is set, which prevents sudo from running as root.",
                "NoNewPrivileges = false",
            ),
        ] {
            let hint = unit_sandbox_hint(output).unwrap_or_default();
            assert!(hint.contains(setting), "{output} -> {hint}");
        }
        assert_eq!(unit_sandbox_hint("backup failed: disk full"), None);
    }

    #[test]
    fn each_sandbox_error_names_its_setting() {
        let cases = [
            (
                "tar: /var/backups/etc.tgz: Cannot open: Read-only file system",
                "ReadWritePaths=",
            ),
            (
                "cronlease: cannot run the job as uid 1000 gid 1000: setting the supplementary groups: EPERM: Operation not permitted",
                "User=root",
            ),
            (
                "sudo: The \"no new privileges\" flag is set, which prevents sudo from running as root.",
                "NoNewPrivileges=no",
            ),
            (
                "cat: /home/ops/.ssh/config: No such file or directory",
                "ProtectHome=read-only",
            ),
            (
                "socket: Address family not supported by protocol",
                "AF_NETLINK",
            ),
            (
                "mprotect failed: Operation not permitted",
                "MemoryDenyWriteExecute=no",
            ),
        ];
        for (output, setting) in cases {
            let hint = sandbox_hint(output).unwrap_or_default();
            assert!(hint.contains(setting), "{output} -> {hint}");
        }
    }

    #[test]
    fn ordinary_failures_get_no_hint() {
        for output in [
            "",
            "backup failed: disk full",
            "curl: (7) Failed to connect to example.org port 443",
            "cat: /srv/data/x: No such file or directory",
            "exit 3",
        ] {
            assert_eq!(sandbox_hint(output), None, "{output}");
        }
    }
}
