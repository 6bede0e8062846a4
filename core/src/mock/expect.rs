//! What a test expects the code under test to send ([`Expect`]) and what the mock device answers ([`Reply`]).

use crate::prm::{CmdStatus, DeliveryStatus, Opcode};

/// Fields a single [`Expect`] or [`Reply`] can name.
pub const MAX_FIELDS: usize = 8;

/// A field of a message by its PRM path (`"cq_context.log_cq_size"`, `"pas[0]"`) and its value.
pub type NamedValue<'a> = (&'a str, u64);

/// How the mock device ends a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Firmware hands the entry back with the reply written.
    Complete,
    /// Firmware never hands the entry back: the driver's command timeout runs out.
    Timeout,
    /// Firmware rejects the entry with this delivery status (written into `status_own`).
    Delivery(DeliveryStatus),
}

/// The mock device's answer to one command: an optional whole output message (as recorded from a device), output
/// fields by PRM name, status and syndrome, how it ends, and an optional page request posted before it completes.
///
/// The output is written in that order: zeros, the whole message, the named fields, then `status` and `syndrome`
/// when they are set, so a recorded output can be corrected field by field.
#[derive(Debug, Clone)]
pub struct Reply<'a> {
    pub(crate) output: Option<&'a [u8]>,
    pub(crate) fields: heapless::Vec<NamedValue<'a>, MAX_FIELDS>,
    pub(crate) status: Option<u8>,
    pub(crate) syndrome: Option<u32>,
    pub(crate) ending: Ending,
    pub(crate) page_request: Option<(u16, i32)>,
    pub(crate) give_back: bool,
    pub(crate) overflow: bool,
}

impl Default for Reply<'_> {
    fn default() -> Self {
        Self::ok()
    }
}

impl<'a> Reply<'a> {
    /// Status OK, every output field 0.
    pub fn ok() -> Self {
        Self {
            output: None,
            fields: heapless::Vec::new(),
            status: None,
            syndrome: None,
            ending: Ending::Complete,
            page_request: None,
            give_back: false,
            overflow: false,
        }
    }

    /// The whole output message as a device wrote it (header included); bytes past the driver's output length
    /// are not written.
    pub fn output(mut self, bytes: &'a [u8]) -> Self {
        self.output = Some(bytes);
        self
    }

    /// An output field by its PRM path in `<opcode>_out` (`"cqn"`, `"capability.cmd_hca_cap.log_max_cq_sz"`).
    pub fn field(mut self, path: &'a str, value: u64) -> Self {
        self.overflow |= self.fields.push((path, value)).is_err();
        self
    }

    /// The command fails with `status` and `syndrome` in its output header.
    pub fn status(mut self, status: CmdStatus, syndrome: u32) -> Self {
        self.status = Some(status.raw());
        self.syndrome = Some(syndrome);
        self
    }

    /// Firmware never hands the entry back.
    pub fn timeout(mut self) -> Self {
        self.ending = Ending::Timeout;
        self
    }

    /// Firmware rejects the entry with a delivery status.
    pub fn delivery(mut self, status: DeliveryStatus) -> Self {
        self.ending = Ending::Delivery(status);
        self
    }

    /// For MANAGE_PAGES take: hand back as many of the pages given earlier (MANAGE_PAGES give, remembered by the
    /// mock as firmware holds them) as the driver asks for, in `output_num_entries` and `pas[]`; a test cannot
    /// know the bus addresses the driver chose.
    pub fn give_back_pages(mut self) -> Self {
        self.give_back = true;
        self
    }

    /// Before completing, firmware asks for pages: a page-request EQE (`function_id`, `num_pages`, negative to
    /// take pages back) is written to the EQ created with the page-request event, and the command completes only
    /// after the next command (the driver's MANAGE_PAGES answer) has been handled. On the CREATE_EQ that makes
    /// the page-request EQ itself, the command completes at once and the driver finds the request when it drains
    /// the new EQ.
    pub fn page_request(mut self, function_id: u16, num_pages: i32) -> Self {
        self.page_request = Some((function_id, num_pages));
        self
    }
}

/// One expected command: its opcode, optionally its `op_mod`, chosen input fields by PRM path or the whole input
/// message, and the [`Reply`].
#[derive(Debug, Clone)]
pub struct Expect<'a> {
    pub(crate) opcode: Opcode,
    pub(crate) op_mod: Option<u16>,
    pub(crate) fields: heapless::Vec<NamedValue<'a>, MAX_FIELDS>,
    pub(crate) input: Option<&'a [u8]>,
    pub(crate) mask: Option<&'a [u8]>,
    pub(crate) prefix: bool,
    pub(crate) reply: Reply<'a>,
    pub(crate) overflow: bool,
}

impl<'a> Expect<'a> {
    /// A command with this opcode, answered with status OK and zeros.
    pub fn cmd(opcode: Opcode) -> Self {
        Self {
            opcode,
            op_mod: None,
            fields: heapless::Vec::new(),
            input: None,
            mask: None,
            prefix: false,
            reply: Reply::ok(),
            overflow: false,
        }
    }

    /// The opcode expected.
    pub fn opcode(&self) -> Opcode {
        self.opcode
    }

    /// The reply it will be answered with.
    pub fn reply_of(&self) -> &Reply<'a> {
        &self.reply
    }

    /// Its `op_mod` must be `op_mod`.
    pub fn op_mod(mut self, op_mod: u16) -> Self {
        self.op_mod = Some(op_mod);
        self
    }

    /// The input field at `path` in `<opcode>_in` must hold `value` (`"cq_context.log_cq_size"`, `"pas[0]"`).
    pub fn field(mut self, path: &'a str, value: u64) -> Self {
        self.overflow |= self.fields.push((path, value)).is_err();
        self
    }

    /// The whole input message must be these bytes (its length included); a difference is reported by the name of
    /// the first field that differs.
    pub fn input(mut self, bytes: &'a [u8]) -> Self {
        self.input = Some(bytes);
        self
    }

    /// The input message must start with these bytes and may go on past them: for a command whose length
    /// depends on where the driver's memory lies (CREATE_MKEY's translation entries).
    pub fn input_prefix(mut self, bytes: &'a [u8]) -> Self {
        self.input = Some(bytes);
        self.prefix = true;
        self
    }

    /// With [`Expect::input`] or [`Expect::input_prefix`]: only the bits set in `mask` are compared (bytes past its end in full), so a recorded
    /// input can leave out what differs from run to run, such as the bus addresses of the driver's buffers.
    pub fn input_mask(mut self, mask: &'a [u8]) -> Self {
        self.mask = Some(mask);
        self
    }

    /// The answer.
    pub fn reply(mut self, reply: Reply<'a>) -> Self {
        self.reply = reply;
        self
    }

    /// Shorthand: an output field of the reply.
    pub fn returns(mut self, path: &'a str, value: u64) -> Self {
        self.reply = self.reply.field(path, value);
        self
    }

    /// Shorthand: the command fails with `status` and `syndrome`.
    pub fn fails(mut self, status: CmdStatus, syndrome: u32) -> Self {
        self.reply = self.reply.status(status, syndrome);
        self
    }

    /// Shorthand: firmware never answers.
    pub fn times_out(mut self) -> Self {
        self.reply = self.reply.timeout();
        self
    }

    /// Shorthand: firmware rejects the entry.
    pub fn delivery_error(mut self, status: DeliveryStatus) -> Self {
        self.reply = self.reply.delivery(status);
        self
    }

    /// Shorthand: MANAGE_PAGES take answered with the pages given earlier ([`Reply::give_back_pages`]).
    pub fn gives_back_pages(mut self) -> Self {
        self.reply = self.reply.give_back_pages();
        self
    }

    /// Shorthand: a page request comes before the completion ([`Reply::page_request`]).
    pub fn page_request(mut self, function_id: u16, num_pages: i32) -> Self {
        self.reply = self.reply.page_request(function_id, num_pages);
        self
    }
}
